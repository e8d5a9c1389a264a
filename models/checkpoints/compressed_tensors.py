"""FP8 checkpoints in the compressed-tensors format (llm-compressor's "float-quantized", the
format IBM's FP8 Granite checkpoints and vLLM's `quant_method: compressed-tensors` use), read
into the card's FP8 weights.

config.json's ``quantization_config`` names the scheme:

    {"quant_method": "compressed-tensors", "format": "float-quantized",
     "config_groups": {"group_0": {"targets": ["Linear"],
                                   "weights": {"type": "float", "num_bits": 8,
                                               "strategy": "channel" | "tensor", ...},
                                   "input_activations": {... "dynamic": true} | null}},
     "ignore": ["lm_head"]}

and each quantized Linear ``X`` stores ``X.weight`` as F8_E4M3 [N, K] and ``X.weight_scale``
([N, 1] a channel, or [1] / [] for the tensor); a static ``X.input_scale`` is read and set
aside: the card multiplies FP8 weights with float inputs (device/kernels/gemm/microkernel.py), so
the model is exactly weight_scale * e4m3(weight) on the checkpoint's activations. The scale
becomes the float16 of each record (bit for bit for a bfloat16 or float16 scale in float16's
normal range; a float32 scale is rounded, and a log line says by how much at most).
"""

from __future__ import annotations

import logging

import numpy as np

from spyre_serve.device.kernels.formats import FMT_FP8
from spyre_serve.device.kernels.simd import QB
from spyre_serve.device.layout import QuantizedWeight

log = logging.getLogger("spyre_serve.models")

FP8_CODE = "F8_E4M3"     # safetensors' dtype code of an E4M3 tensor
_SCALE_CODES = ("F32", "BF16", "F16")


class QuantizationConfigError(ValueError):
    """A quantization_config this loader does not serve, named with what it says."""


def fp8_weight_scheme(quantization_config: dict | None) -> str | None:
    """The weights' strategy ("channel" or "tensor") of an FP8 compressed-tensors config;
    None without a quantization_config; QuantizationConfigError for any other scheme."""
    if not quantization_config:
        return None
    method = quantization_config.get("quant_method")
    if method != "compressed-tensors":
        raise QuantizationConfigError(f"quantization_config's quant_method {method!r} is not "
                                      "served; FP8 checkpoints in compressed-tensors are")
    strategies = set()
    for name, group in (quantization_config.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise QuantizationConfigError(
                f"compressed-tensors group {name!r}: weights of type {w.get('type')!r} at "
                f"{w.get('num_bits')} bits; only float 8-bit (FP8 E4M3) weights are served")
        if w.get("strategy") not in ("channel", "tensor"):
            raise QuantizationConfigError(f"compressed-tensors group {name!r}: weight strategy "
                                          f"{w.get('strategy')!r}; channel or tensor are served")
        strategies.add(w["strategy"])
    if not strategies:
        raise QuantizationConfigError("compressed-tensors quantization_config has no config_groups")
    return "channel" if "channel" in strategies else "tensor"


def take_fp8_weights(stored: dict[str, tuple[str, np.ndarray]], source,
                     widen) -> dict[str, QuantizedWeight]:
    """Every F8_E4M3 ``X.weight`` of ``stored`` (name -> (dtype code, stored array)) with its
    ``X.weight_scale`` (a float tensor, made float32 by ``widen(code, array)``: the
    checkpoint reader's), as FMT_FP8 weights; the scales and input scales are removed from
    ``stored``, the weights stay there (their shapes are checked with the rest)."""
    out = {}
    for name in [n for n, (code, _) in stored.items() if code == FP8_CODE]:
        if not name.endswith(".weight"):
            raise QuantizationConfigError(f"{source}: F8_E4M3 tensor {name!r} is not a weight")
        q = np.ascontiguousarray(stored[name][1])
        scale_name = name + "_scale"
        if scale_name not in stored:
            raise QuantizationConfigError(f"{source}: FP8 weight {name!r} has no {scale_name!r}")
        n, k = q.shape
        if k % QB:
            raise QuantizationConfigError(f"{source}: FP8 weight {name!r} [{n}, {k}]: rows in "
                                          f"whole blocks of {QB} are served")
        code, raw = stored.pop(scale_name)
        if code not in _SCALE_CODES:
            raise QuantizationConfigError(f"{source}: {scale_name!r} is stored as {code}; "
                                          f"{', '.join(_SCALE_CODES)} are served")
        scale = np.asarray(widen(code, raw), np.float32).reshape(-1)
        if scale.size not in (1, n):
            raise QuantizationConfigError(f"{source}: {scale_name!r} has {scale.size} values; a "
                                          f"channel's ({n}) or the tensor's (1) are served")
        s = np.broadcast_to(scale, (n,)).astype(np.float32)
        d16 = s.astype(np.float16)
        nz = s != 0
        worst = float(np.max(np.abs(d16[nz].astype(np.float32) / s[nz] - 1), initial=0.0))
        if worst > 0:
            log.info("%s: its scales rounded to float16, by at most %.2g relative", name, worst)
        out[name] = QuantizedWeight(FMT_FP8, q, np.repeat(d16[:, None], k // QB, axis=1))
        stored.pop(name[:-len(".weight")] + ".input_scale", None)
    return out

