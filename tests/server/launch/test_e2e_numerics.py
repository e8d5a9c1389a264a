"""--numerics spyre over HTTP: every kind of model the server serves (the embedded granite-tiny,
Granite and Llama checkpoints, a Q4_1 GGUF file, fp8 weights quantized at load) computes as the
card does (DLFloat16 weights, GEMM inputs and KV cache) and says so in system_fingerprint; its
greedy choices agree with float32's.

Agreement is measured teacher-forced, as a parity check must be (a free-running continuation
stops being comparable at its first different token): both servers score the same token
sequences (`prompt_logprobs`: each position's two most likely next tokens and their
probabilities), and at every position where float32's top token is at least RESOLVED (2%)
more likely than its second (a logit gap of ln 1.02) the spyre server's top token must be
float32's on at least AGREEMENT of them. Measured on
this suite's models (2026-12-04, amx): granite-tiny 22 of 22, granite 361/361, llama 490/496
(98.8%), the Q4_1 GGUF 416/423 (98.3%), fp8 349/349; each is logged as the test runs.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import httpx
import numpy as np
import pytest

from spyre_serve.models import resolve_model
from spyre_serve.models.checkpoints.profiles import ASSETS, TINY, init_tensors
from spyre_serve.server.launch.cli import build
from spyre_serve.server.launch.settings import Settings
from tests.models.gguf_files import Q, write_gguf
from tests.models.hf_checkpoints import write_granite_checkpoint
from tests.server.servers import ServerThread, real_settings

log = logging.getLogger(__name__)
RESOLVED = 0.02      # p1 >= (1 + RESOLVED) p2
AGREEMENT = 0.90
SEQUENCES = [list(range(100, 260)), list(np.random.default_rng(7).integers(10, 8000, 200)),
             [400 + (i * 37) % 900 for i in range(150)]]
STRONG = dict(embedding=0.3, qkv=0.3, o=0.3, gate_up=0.3, down=0.3, norm_jitter=0.1)


def _gguf(root):
    config = dataclasses.replace(TINY.config, num_hidden_layers=2)
    tensors = dict(init_tensors(config, dataclasses.replace(TINY.stds, **STRONG), seed=5))
    write_gguf(root / "m.Q4_1.gguf", config, tensors, qtype=Q.Q4_1, tokenizer_dir=ASSETS)
    return root / "m.Q4_1.gguf"


MODELS = {  # name: (the model, settings both servers share, float32's own)
    "granite-tiny": (lambda root: resolve_model("granite-tiny"), {}, {}),
    "granite": (lambda root: write_granite_checkpoint(root, vocab=8192, hidden=128, layers=2, heads=4,
                                                      kv_heads=2, init_std=0.3, with_tokenizer=True), {}, {}),
    "llama": (lambda root: write_granite_checkpoint(root, vocab=8192, hidden=128, layers=2, heads=4,
                                                    kv_heads=1, tie=False, init_std=0.3, llama=True,
                                                    with_tokenizer=True), {}, {}),
    "gguf-q4_1": (_gguf, {}, {"compute_dtype": "float32"}),
    "fp8": (lambda root: write_granite_checkpoint(root, vocab=8192, hidden=128, layers=2, heads=4,
                                                  kv_heads=2, intermediate=512, init_std=0.3, seed=3,
                                                  with_tokenizer=True),
            {"quantization": "fp8"}, {}),
}


def scored(model, **settings):
    """(each sequence's per-position {top token, its probability, the second's}, the answers'
    system_fingerprint, the runner's formats) from a real server."""
    s = real_settings(model=str(model), **settings)
    built = build(s, progress=False)
    try:
        with ServerThread(built.app) as server, httpx.Client(base_url=server.url, timeout=300) as c:
            out = []
            for seq in SEQUENCES:
                r = c.post("/v1/completions", json={"prompt": [int(t) for t in seq], "max_tokens": 1,
                                                    "temperature": 0, "prompt_logprobs": 2})
                assert r.status_code == 200, r.text
                body = r.json()
                out.append([top_two(p) for p in body["choices"][0]["prompt_logprobs"][1:]])
            return out, body["system_fingerprint"], (built.runner.compute_dtype, built.runner.kv_cache_dtype,
                                                     built.model.weights.dtype)
    finally:
        built.engine.shutdown()
        built.card.close()


def top_two(position: dict) -> tuple[int, float, float]:
    """(the rank-1 token, its probability, the rank-2 token's) of one prompt_logprobs entry."""
    by_rank = {v["rank"]: (int(k), math.exp(v["logprob"])) for k, v in position.items()}
    return by_rank[1][0], by_rank[1][1], by_rank[2][1]


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, tmp_path_factory):
    make, shared, own = MODELS[request.param]
    model = make(tmp_path_factory.mktemp(request.param))
    ref = scored(model, **shared, **own)
    spyre = scored(model, **shared, numerics="spyre")
    return request.param, ref, spyre


def test_spyre_numerics_agree_with_float32_where_float32_resolves(pair):
    name, (ref, ref_fp, _), (got, fp, formats) = pair
    resolved = agree = 0
    for ref_seq, got_seq in zip(ref, got, strict=True):
        for (want, p1, p2), (top, _, _) in zip(ref_seq, got_seq, strict=True):
            if p1 >= (1 + RESOLVED) * p2:
                resolved += 1
                agree += top == want
    log.warning("%s: spyre numerics agree with float32 on %d of %d resolved positions (%.1f%%)",
                name, agree, resolved, 100 * agree / max(resolved, 1))
    assert resolved >= 20, (name, resolved)          # enough positions to measure
    assert agree >= AGREEMENT * resolved, (name, agree, resolved)


def test_spyre_numerics_compute_in_dlfloat16_and_say_so(pair):
    name, (_, ref_fp, _), (_, fp, (compute, kv, weights)) = pair
    assert (weights, kv) == ("dlfloat16", "dlfloat16")
    assert compute == ("int8" if name == "gguf-q4_1" else "dlfloat16")   # integer quants keep int8
    assert f"compute={compute}" in fp and "kv=dlfloat16" in fp and "isa=" in fp
    assert fp != ref_fp and "kv=dlfloat16" not in ref_fp


def test_spyre_numerics_refuse_a_contradicting_width():
    with pytest.raises(ValueError, match="--dtype bfloat16 contradicts it"):
        Settings(numerics="spyre", dtype="bfloat16").with_numerics()
    s = Settings(numerics="spyre").with_numerics()
    assert (s.dtype, s.kv_cache_dtype, s.compute_dtype) == ("dlfloat16", "dlfloat16", "auto")
