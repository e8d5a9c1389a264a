"""8- and 4-bit weights served over HTTP: a Q4_1 GGUF file at its width, and a float checkpoint
with --quantization int8 or fp8, and an FP8 checkpoint in the compressed-tensors format, each
answering greedy requests with the text of a float32 checkpoint holding the same (dequantized)
weights."""

from __future__ import annotations

import dataclasses
import json
import shutil

import httpx
import numpy as np
import pytest
import torch

from spyre_serve.models.checkpoints.profiles import ASSETS, TINY, TOKENIZER_FILES, init_tensors
from spyre_serve.models.checkpoints.quantize import quantize_matrices
from spyre_serve.server.launch.cli import build
from tests.models.gguf_files import Q, write_gguf, write_numpy_checkpoint
from tests.server.servers import ServerThread, real_settings

PROMPTS = ["The river", "Once upon a time there was", "1, 2, 3,"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A 2-layer granite-tiny-shaped model (its tokenizer) as a Q4_1 GGUF, its float32 twin, the
    float checkpoint it was quantized from, and a float32 twin of that one's int8 weights."""
    root = tmp_path_factory.mktemp("quantized")
    config = dataclasses.replace(TINY.config, num_hidden_layers=2)
    tensors = dict(init_tensors(config, TINY.stds, seed=5))

    def with_tokenizer(d):
        for f in TOKENIZER_FILES:
            shutil.copyfile(ASSETS / f, d / f)
        return d

    held = write_gguf(root / "m.Q4_1.gguf", config, tensors, qtype=Q.Q4_1, tokenizer_dir=ASSETS)
    int8, fp8 = ({n: t.dequantize() if hasattr(t, "dequantize") else t
                  for n, t in quantize_matrices(tensors, method).items()} for method in ("int8", "fp8"))
    return {"gguf": root / "m.Q4_1.gguf",
            "gguf_twin": with_tokenizer(write_numpy_checkpoint(root / "gguf_twin", config, held)),
            "float": with_tokenizer(write_numpy_checkpoint(root / "float", config, tensors)),
            "int8_twin": with_tokenizer(write_numpy_checkpoint(root / "int8_twin", config, int8)),
            "fp8_twin": with_tokenizer(write_numpy_checkpoint(root / "fp8_twin", config, fp8)),
            **write_compressed_tensors_fp8(root, config, tensors, with_tokenizer)}


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_compressed_tensors_fp8(root, config, tensors, with_tokenizer):
    """An FP8 checkpoint as llm-compressor writes one (torch's float8_e4m3fn cast, bfloat16
    scales a channel, a static input_scale on one layer, lm_head and norms float32) and its
    float32 twin: {"ct_fp8": dir, "ct_fp8_twin": dir}."""
    from safetensors.torch import save_file

    out, twin = {}, {}
    for name, t in tensors.items():
        w = torch.from_numpy(np.ascontiguousarray(t))
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            scale = (w.abs().amax(dim=1, keepdim=True) / 448).to(torch.bfloat16)
            q = (w / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[name], out[name + "_scale"] = q, scale
            twin[name] = (q.float() * scale.float()).numpy()
            if name.startswith("model.layers.0.self_attn.q_proj"):
                out[name.replace(".weight", ".input_scale")] = torch.ones(1, dtype=torch.bfloat16)
        else:
            out[name], twin[name] = w, t
    ct = root / "ct_fp8"
    ct.mkdir()
    save_file(out, str(ct / "model.safetensors"))
    cfg = config.to_dict() | {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                      "weights": {"type": "float", "num_bits": 8,
                                                  "strategy": "channel", "symmetric": True}}}}}
    (ct / "config.json").write_text(json.dumps(cfg))
    return {"ct_fp8": with_tokenizer(ct),
            "ct_fp8_twin": with_tokenizer(write_numpy_checkpoint(root / "ct_twin", config, twin))}


def serve_greedy(model, **settings):
    """(greedy completions of PROMPTS, the weights' formats on the card, the GEMM inputs'
    format the runner resolved) from a real server."""
    built = build(real_settings(model=str(model), **settings), progress=False)
    try:
        with ServerThread(built.app) as server, httpx.Client(base_url=server.url, timeout=300) as c:
            texts = []
            for p in PROMPTS:
                r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0,
                                                    "ignore_eos": True})
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["text"])
            return texts, built.model.weights.formats, built.runner.compute_dtype
    finally:
        built.engine.shutdown()
        built.card.close()


def test_a_q4_1_gguf_is_served_at_its_width_with_its_twins_text(checkpoints):
    texts, formats, compute = serve_greedy(checkpoints["gguf"], compute_dtype="float32")
    want, want_formats, want_compute = serve_greedy(checkpoints["gguf_twin"])
    assert (compute, want_compute) == ("float32", "float32")     # auto: a float model keeps float32
    assert texts == want and len(set(texts)) == len(PROMPTS)
    assert set(formats) == {"Q4_1"} and set(want_formats) == {"float32"}
    assert formats["Q4_1"] < 0.2 * want_formats["float32"]          # 5 bits a weight, not 32


def test_quantization_int8_serves_the_int8_weights(checkpoints):
    texts, formats, _ = serve_greedy(checkpoints["float"], quantization="int8", compute_dtype="float32")
    want, _, want_compute = serve_greedy(checkpoints["int8_twin"])
    assert texts == want and want_compute == "float32"
    assert set(formats) == {"Q8_0"}             # int8 per channel, in Q8_0's layout


def test_quantization_fp8_serves_the_fp8_weights_with_float_inputs(checkpoints):
    """E4M3 weights, a scale a channel, kept 8-bit on the card; auto keeps the checkpoint's
    float32 inputs (no int8 path for float quants): the fp8-dequantized twin's text."""
    texts, formats, compute = serve_greedy(checkpoints["float"], quantization="fp8")
    want, want_formats, _ = serve_greedy(checkpoints["fp8_twin"])
    assert compute == "float32" and texts == want and len(set(texts)) == len(PROMPTS)
    assert set(formats) == {"FP8_E4M3"}
    assert formats["FP8_E4M3"] < 0.3 * want_formats["float32"]      # 8.5 bits a weight


def test_a_compressed_tensors_fp8_checkpoint_is_served_at_its_width(checkpoints):
    texts, formats, compute = serve_greedy(checkpoints["ct_fp8"])
    want, _, _ = serve_greedy(checkpoints["ct_fp8_twin"])
    assert compute == "float32" and texts == want and len(set(texts)) == len(PROMPTS)
    assert "FP8_E4M3" in formats


def test_by_default_quantized_weights_take_int8_activations(checkpoints):
    """auto: int8 activations for a quantized model (the numerics are tested on a trained model,
    tests/models/gguf/test_smollm2.py), and it serves; a float model keeps float32 (the twins above)."""
    texts, _, compute = serve_greedy(checkpoints["gguf"])
    assert compute == "int8"
    assert len(texts) == len(PROMPTS) and all(texts)


def test_quantization_of_a_gguf_file_is_refused(checkpoints):
    with pytest.raises(ValueError, match="served in the formats it stores"):
        build(real_settings(model=str(checkpoints["gguf"]), quantization="int8"), progress=False)


def test_a_compressed_tensors_fp8_checkpoint_gives_transformers_greedy_tokens_on_its_dequantized_weights(
        checkpoints):
    """The FP8 checkpoint served at its width, float32 activations, against transformers'
    GraniteForCausalLM on the dequantized weights (the twin): the same greedy text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts, _, compute = serve_greedy(checkpoints["ct_fp8"])
    twin = checkpoints["ct_fp8_twin"]
    tok = AutoTokenizer.from_pretrained(twin)
    ref = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt")["input_ids"]
            out = ref.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
            want.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert compute == "float32" and texts == want
