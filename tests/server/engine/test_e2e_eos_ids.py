"""A checkpoint whose config.json lists several eos_token_id values, on the real stack.

granite-tiny's config says ``"eos_token_id": 0`` (its tokenizer's EOS too). The copy
here (weights and tokenizer linked, config.json rewritten) lists two other ids: the
token granite-tiny's greedy continuation of PROMPT produces at step k, learnt once from
the session's server, and an id greedy does not produce. The engine must stop on the
listed ids and on the tokenizer's EOS, and ban all of them while min_tokens is unmet.
"""

from __future__ import annotations

import json

import pytest

from spyre_serve.models import SamplingParams
from spyre_serve.server.sched.sequence import GenerationParams
from tests.server.fakes import Collector
from tests.server.servers import PROMPT, real_settings

MAX_TOKENS = 8
EOS_NEXT = [7470]  # granite-tiny's greedy next token is its EOS (see test_e2e_min_tokens.py)


def generate(engine, prompt_ids, timeout=600, **kw) -> Collector:
    params = GenerationParams(sampling=SamplingParams(temperature=0.0), max_tokens=MAX_TOKENS, **kw)
    c = Collector()
    engine.add_request(f"eos-{id(c)}", list(prompt_ids), [params], c)
    return c.wait(timeout)


@pytest.fixture(scope="module")
def eos_list(real_server, tmp_path_factory):
    """(engine on the copy, prompt ids, greedy ids of PROMPT ignoring EOS, k, the listed ids)."""
    from spyre_serve.server.launch.cli import build

    base = real_server.built
    tok = base.model.tokenizer
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    free = generate(base.engine, prompt, ignore_eos=True).token_ids
    assert len(free) == MAX_TOKENS
    k = next(i for i in range(2, MAX_TOKENS) if free[i] not in free[:i] and free[i] != tok.eos_token_id)
    other = next(t for t in range(base.model.config.vocab_size - 1, 0, -1) if t not in free)
    listed = [free[k], other]

    src = base.model.path
    dst = tmp_path_factory.mktemp("granite-tiny-eos-list")
    for f in src.iterdir():     # generation_config.json's eos ids would join the list
        if f.name not in ("config.json", "generation_config.json"):
            (dst / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    config["eos_token_id"] = listed
    (dst / "config.json").write_text(json.dumps(config))

    built = build(real_settings(model=str(dst)), progress=False)
    assert built.model.config.eos_token_id == listed
    assert tok.eos_token_id not in listed
    yield built.engine, prompt, free, k, listed
    built.engine.shutdown()
    built.card.close()


def test_the_engine_stops_on_every_listed_eos_id_and_the_tokenizers(eos_list):
    engine, prompt, free, k, listed = eos_list
    assert engine.eos_token_ids == {*listed, engine.tokenizer.eos_token_id}
    c = generate(engine, prompt)
    assert c.token_ids == free[: k + 1]
    assert (c.last.finish_reason, c.last.stop_reason) == ("stop", None)
    # the tokenizer's EOS still stops although the config does not list it
    c = generate(engine, EOS_NEXT)
    assert c.token_ids == [engine.tokenizer.eos_token_id] and c.last.finish_reason == "stop"


def test_ignore_eos_runs_past_the_listed_ids(eos_list):
    engine, prompt, free, _, _ = eos_list
    c = generate(engine, prompt, ignore_eos=True)
    assert c.token_ids == free and c.last.finish_reason == "length"


def test_min_tokens_bans_every_eos_id_until_then(eos_list):
    engine, prompt, free, k, listed = eos_list
    c = generate(engine, prompt, min_tokens=k + 1)
    ids = c.token_ids
    assert ids[:k] == free[:k]
    banned = {*listed, engine.tokenizer.eos_token_id}
    assert not banned & set(ids[: k + 1])
    if banned & set(ids):  # allowed again after min_tokens, and then it stops
        assert ids[-1] in banned and len(ids) > k + 1 and c.last.finish_reason == "stop"
    else:
        assert len(ids) == MAX_TOKENS and c.last.finish_reason == "length"
