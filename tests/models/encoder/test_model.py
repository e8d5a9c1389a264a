"""RoBERTa-family encoders on the card (models/encoder_*.py): the config and its refusals, the
sentence-transformers pooling defaults, and the runner's pooled embeddings against
transformers' (fp32 last_hidden_state pooled the same way, unit length), for prompts of
different lengths batched in one launch and each alone, CLS and MEAN, RobertaModel and
XLMRobertaModel; what the runner refuses, and what the engine reads of it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from spyre_serve.device import Card
from spyre_serve.models import SamplingParams, SeqWork, load_model
from spyre_serve.models.config import ConfigError
from spyre_serve.models.encoder.config import (
    EncoderConfig,
    is_encoder_config,
    parse_encoder_config,
    pooler_defaults,
)
from spyre_serve.models.encoder.runner import EncoderRunner
from spyre_serve.models.step.interface import SeqWorkError
from tests.models.encoder_checkpoints import reference_pooled, write_encoder_checkpoint

TEXTS = ["Embeddings pool a prompt.", "Quick brown foxes",
         "The card runs one program per step.", "a"]
RAW = [[0, 17, 250, 9, 2], [0, 2], [0] + list(range(5, 35)) + [2]]     # the last: 32 tokens


@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory):
    """RobertaModel without sentence-transformers files (CLS by default)."""
    return write_encoder_checkpoint(tmp_path_factory.mktemp("roberta"), seed=1)


@pytest.fixture(scope="module")
def xlm_dir(tmp_path_factory):
    """XLMRobertaModel whose sentence-transformers files ask for mean pooling."""
    return write_encoder_checkpoint(tmp_path_factory.mktemp("xlm"), xlm=True, seed=2,
                                    pooling="MEAN")


@pytest.fixture(scope="module")
def prompts(roberta_dir):
    from spyre_serve.models.checkpoints.tokenizer import load_tokenizer

    tok = load_tokenizer(roberta_dir)
    encoded = [tok(t)["input_ids"] for t in TEXTS]
    assert all(e[0] == 0 and e[-1] == 2 for e in encoded)        # <s> ... </s>, as RoBERTa's
    assert len({len(e) for e in encoded}) == len(encoded)
    return encoded + RAW


def embed(path, prompts, batched=True, pooling=None, max_num_batched_tokens=128):
    """The runner's pooled rows of `prompts` (one launch, or one launch each)."""
    card = Card(64 << 20)
    try:
        model = load_model(path, card)
        kind = pooling or pooler_defaults(path)[0]
        runner = EncoderRunner(model, card, max_num_seqs=8,
                               max_num_batched_tokens=max_num_batched_tokens, pooling_type=kind,
                               block_size=16)
        try:
            work = [SeqWork(10 + i, list(p), 0, [], True, SamplingParams())
                    for i, p in enumerate(prompts)]
            if batched:
                out = runner.launch(work).result()
                assert out.seq_ids == [w.seq_id for w in work]
                assert out.token_ids.shape == (len(work),) and out.top_ids.shape == (len(work), 0)
                return out.pooled
            return np.concatenate([runner.launch([w]).result().pooled for w in work])
        finally:
            runner.close()
    finally:
        card.close()


def assert_parity(got, want):
    assert got.shape == want.shape and got.dtype == np.float32
    for g, w in zip(got, want, strict=True):
        assert 1.0 - float(g @ w) / float(np.linalg.norm(g) * np.linalg.norm(w)) <= 1e-5
    np.testing.assert_allclose(got, want, atol=2e-5)
    cos = want @ want.T                     # the prompts' embeddings are not all alike
    assert cos[np.triu_indices(len(want), 1)].max() < 0.99


# ---- config --------------------------------------------------------------------------------

def test_config_reads_the_checkpoint(roberta_dir, xlm_dir):
    cfg = EncoderConfig.from_file(roberta_dir)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim) == \
        ("RobertaModel", 64, 4, 16)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (1, 0, [2])
    assert cfg.max_position_embeddings == 34 and cfg.max_model_len == 32
    assert EncoderConfig.from_file(xlm_dir).architecture == "XLMRobertaModel"
    assert is_encoder_config(roberta_dir) and is_encoder_config(xlm_dir)


def test_is_encoder_config_is_false_for_a_decoder_and_garbage(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert not is_encoder_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    assert not is_encoder_config(tmp_path)
    assert not is_encoder_config(tmp_path / "missing")


@pytest.mark.parametrize("field, value", [("hidden_act", "relu"),
                                          ("position_embedding_type", "relative_key"),
                                          ("is_decoder", True), ("pad_token_id", None)])
def test_config_refuses_what_the_step_does_not_implement(roberta_dir, field, value):
    d = json.loads((roberta_dir / "config.json").read_text())
    d[field] = value
    with pytest.raises(ConfigError, match=f"'{field}' is {value!r}"):
        parse_encoder_config(d)


def test_pooler_defaults_read_sentence_transformers_files(roberta_dir, xlm_dir, tmp_path):
    assert pooler_defaults(roberta_dir) == ("CLS", True)      # vLLM's RoBERTa default
    assert pooler_defaults(xlm_dir) == ("MEAN", True)
    from tests.models.encoder_checkpoints import write_sentence_transformers

    write_sentence_transformers(tmp_path, "pooling_mode_max_tokens", 64)
    with pytest.raises(ConfigError, match="pooling_mode_max_tokens"):
        pooler_defaults(tmp_path)


# ---- parity --------------------------------------------------------------------------------

@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("pooling", ["CLS", "MEAN"])
def test_roberta_embeddings_match_transformers(roberta_dir, prompts, pooling, batched):
    assert_parity(embed(roberta_dir, prompts, batched, pooling),
                  reference_pooled(roberta_dir, prompts, pooling))


@pytest.mark.parametrize("batched", [True, False])
def test_xlm_roberta_embeddings_match_transformers_with_its_mean_pooling(xlm_dir, prompts,
                                                                         batched):
    assert_parity(embed(xlm_dir, prompts, batched), reference_pooled(xlm_dir, prompts, "MEAN"))


def test_a_masked_lm_checkpoint_serves_its_encoder(tmp_path, prompts):
    path = write_encoder_checkpoint(tmp_path / "mlm", masked_lm=True, seed=3)
    assert_parity(embed(path, prompts[:3]), reference_pooled(path, prompts[:3], "CLS"))


# ---- the runner ----------------------------------------------------------------------------

def test_runner_refuses_what_is_not_a_whole_prompt_it_holds(roberta_dir):
    card = Card(64 << 20)
    runner = EncoderRunner(load_model(roberta_dir, card, tokenizer=False), card, max_num_seqs=4,
                           max_num_batched_tokens=64, block_size=16)
    try:
        assert runner.max_model_len == 32                # 34 positions after pad 1
        sp = SamplingParams()
        good = SeqWork(1, [0, 5, 2], 0, [], True, sp)
        with pytest.raises(SeqWorkError) as err:
            runner.launch([good, SeqWork(2, [0] * 33, 0, [], True, sp),       # over max_model_len
                           SeqWork(3, [7, 2], 4, [], True, sp),               # not from 0
                           SeqWork(4, [0, 300], 0, [], True, sp)])            # outside the vocab
        assert err.value.seq_ids == (2, 3, 4)
        assert "33 tokens" in err.value.reasons[2] and "max_model_len" in err.value.reasons[2]
        assert "token id 300" in err.value.reasons[4]
        alone = runner.launch([good]).result()          # the runner is as it was
        np.testing.assert_allclose(np.linalg.norm(alone.pooled[0]), 1.0, rtol=1e-6)
    finally:
        runner.close()
        card.close()


def test_runner_offers_what_the_engine_and_cli_read(roberta_dir):
    from spyre_serve.server.engine.seams import check_runner

    card = Card(64 << 20)
    model = load_model(roberta_dir, card)
    runner = EncoderRunner(model, card, max_num_seqs=4, max_num_batched_tokens=32, block_size=16)
    try:
        check_runner(runner)
        assert runner.pooling == ("CLS", True)
        assert runner.max_model_len == 32 and runner.num_kv_blocks == 4 * 2
        assert (runner.compute_dtype, runner.kv_cache_dtype) == ("float32", "none")
        assert runner.numerics.startswith("weights=float32,compute=float32,kv=none,isa=")
        plan = runner.memory_plan
        assert plan["kv_cache"] == 0 and plan["weights"] == model.weights.nbytes > 0
        assert plan["scratch"] == plan["workspace"] + plan["io"] + plan["layer_table"]
        runner.warmup(progress=False)
        assert sorted(runner.programs) == runner.bucket_shapes()
        compiles = card.counters.snapshot()["compiles"]
        handle = runner.launch([SeqWork(7, [0, 9, 9, 2], 0, [], False, SamplingParams(),
                                        pool=True)])          # as the server sends an embedding
        assert handle.bucket == (4, 1)
        out = handle.result()
        assert out.seq_ids == [7] and out.pooled.shape == (1, 64) and handle.done()
        runner.forget(7)
        assert runner.held() == {}
        assert card.counters.snapshot()["compiles"] == compiles
    finally:
        runner.close()
        card.close()
