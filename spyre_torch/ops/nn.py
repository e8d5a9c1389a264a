"""Neural-network ops taken whole: embedding (one gather) and scaled_dot_product_attention
(one launch of the attention kernel, masks, causal and grouped-query heads included).

torch would decompose `scaled_dot_product_attention` on a backend without a fused kernel into
a dozen ops; registering the spyre kernel on the composite op itself keeps it one launch.
"""

from __future__ import annotations

import math

import torch

from spyre_torch import dtypes, memory
from spyre_torch.memory import address
from spyre_torch.ops import aten
from spyre_torch.ops.copy import card_copy, row_major
from spyre_torch.ops.fallback import NoCardKernel
from spyre_torch.ops.launch import broadcast_strides, launch


def gather(name: str, x: torch.Tensor, idx: torch.Tensor, outer: int, size: int, inner: int,
           strides: tuple[int, int, int], out: torch.Tensor, wrap: bool) -> torch.Tensor:
    """out[o, j, i] = x[o, idx[j], i] (x seen as [outer, size, inner] through `strides`)."""
    if idx.dtype not in (torch.int64, torch.int32):
        raise RuntimeError(f"spyre: {name}: indices must be int64 or int32, got {idx.dtype}")
    if dtypes.code(x.dtype) is None:
        raise NoCardKernel(f"dtype {x.dtype}")
    if idx.device.type != "spyre":
        idx = idx.to("spyre")
    if not row_major(idx):
        idx = card_copy(memory.empty(idx.shape, idx.dtype), idx)
    bindings = {
        "outer": outer, "j": idx.numel(), "inner": inner, "dim_size": size, "wrap": int(wrap),
        "x_dt": dtypes.CODES[x.dtype], "x_os": strides[0], "x_ds": strides[1],
        "x_is": strides[2], "idx_dt": dtypes.CODES[idx.dtype], "idx_st": 1,
        "x": address(x), "idx": address(idx), "out": address(out),
    }
    if out.numel():
        launch(name, "gather", bindings)
    return out


@aten("embedding")
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if weight.dim() != 2:
        raise RuntimeError(f"spyre: embedding: 'weight' must be 2-D, got {weight.dim()}-D")
    v, h = weight.shape
    out = memory.empty((*indices.shape, h), weight.dtype)
    return gather("aten::embedding", weight, indices, 1, v, h,
                  (0, weight.stride(0), weight.stride(1)), out, wrap=False)


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return card_copy(memory.empty(t.shape, t.dtype), t)
    return t


@aten("scaled_dot_product_attention")
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    name = "aten::scaled_dot_product_attention"
    if dropout_p > 0.0:
        raise NoCardKernel("dropout")
    for t in (query, key, value):
        if t.dtype != torch.float32:
            raise NoCardKernel(f"dtype {t.dtype} (the attention kernel is float32)")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise NoCardKernel("inputs other than [batch, heads, tokens, head_dim]")
    if is_causal and attn_mask is not None:
        raise RuntimeError("spyre: scaled_dot_product_attention: explicit attn_mask should not "
                           "be set when is_causal=True")
    b, hq, seq_l, d = query.shape
    bk, hkv, seq_s, dk = key.shape
    dv = value.shape[-1]
    if bk != b or value.shape[0] != b or dk != d or value.shape[1] != hkv or value.shape[2] != seq_s:
        raise NoCardKernel(f"shapes q {list(query.shape)} k {list(key.shape)} v {list(value.shape)}")
    if hq != hkv and not (enable_gqa and hq % hkv == 0):
        raise RuntimeError(f"spyre: scaled_dot_product_attention: {hq} query heads and {hkv} "
                           f"key/value heads need enable_gqa=True and a whole number of groups")
    q, k, v = _last_dim_unit(query), _last_dim_unit(key), _last_dim_unit(value)
    out = memory.empty((b, hq, seq_l, dv), torch.float32)
    bindings = {
        "batch": b, "hq": hq, "hkv": hkv, "l": seq_l, "s": seq_s, "d": d, "dv": dv,
        "causal": int(bool(is_causal)),
        "scale": dtypes.float_bits(1.0 / math.sqrt(d) if scale is None else float(scale)),
        "mask_dt": dtypes.NONE,
        "q": address(q), "k": address(k), "v": address(v), "out": address(out),
        "q_bs": q.stride(0), "q_hs": q.stride(1), "q_ls": q.stride(2),
        "k_bs": k.stride(0), "k_hs": k.stride(1), "k_ss": k.stride(2),
        "v_bs": v.stride(0), "v_hs": v.stride(1), "v_ss": v.stride(2),
    }
    if attn_mask is not None:
        if attn_mask.dtype not in (torch.bool, torch.float32):
            raise NoCardKernel(f"a mask of dtype {attn_mask.dtype}")
        if attn_mask.device.type != "spyre":
            attn_mask = attn_mask.to("spyre")
        st = broadcast_strides(attn_mask, (b, hq, seq_l, seq_s))
        bindings.update(mask=address(attn_mask), mask_dt=dtypes.CODES[attn_mask.dtype],
                        m_bs=st[0], m_hs=st[1], m_ls=st[2], m_ss=st[3])
    if out.numel():
        launch(name, "attention", bindings)
    return out
