"""The MoE kernels against numpy (routing, grouping by expert) and the whole block, experts on
packed weights in an arena, against transformers' GraniteMoeHybridMoE on the same weights."""

import numpy as np
import pytest
import torch
from transformers import GraniteMoeHybridConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMoE

from spyre_serve.device.kernels.formats import FMT_BF16, FMT_F32
from spyre_serve.device.kernels.gemm.inputs import ACT_F32
from spyre_serve.device.kernels.moe import moe_experts_at, moe_order, moe_route
from spyre_serve.device.layout import pack, unpack


def route_reference(logits, k):
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, ids, 1).astype(np.float64)
    w = np.exp(top - top[:, :1])
    return ids, w / w.sum(1, keepdims=True)


@pytest.mark.parametrize("t,e,k", [(1, 4, 1), (9, 8, 2), (33, 5, 5)])
def test_route_is_the_top_k_and_their_softmax(t, e, k):
    rng = np.random.default_rng(t * e + k)
    logits = rng.standard_normal((t, e), dtype=np.float32)
    ids, weights = np.full((t, k), -1, np.int32), np.full((t, k), np.nan, np.float32)
    moe_route(ids, weights, logits)
    want_ids, want_w = route_reference(logits, k)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=1e-6, atol=1e-7)


def test_ties_take_the_lower_expert_first():
    ids, weights = np.empty((1, 2), np.int32), np.empty((1, 2), np.float32)
    moe_route(ids, weights, np.array([[0.5, 1.0, 1.0, 1.0]], np.float32))
    assert ids.tolist() == [[1, 2]] and weights.tolist() == [[0.5, 0.5]]


def test_order_groups_the_pairs_by_expert_in_row_order():
    ids = np.array([[2, 0], [0, 3], [2, 3], [0, 2]], np.int32)
    order, starts = np.empty(8, np.int32), np.empty(5, np.int32)
    moe_order(order, starts, ids)
    assert starts.tolist() == [0, 3, 3, 6, 8]                      # expert 1: no rows
    assert order.tolist() == [1, 2, 6, 0, 4, 7, 3, 5]             # row * k + choice


def test_bad_routes_are_refused():
    with pytest.raises(ValueError, match="expert id out of range"):
        moe_order(np.empty(2, np.int32), np.empty(3, np.int32), np.array([[0, 2]], np.int32))
    with pytest.raises(ValueError, match="1 <= k <= E"):
        moe_route(np.empty((1, 3), np.int32), np.empty((1, 3), np.float32), np.zeros((1, 2), np.float32))


def _arena(mats, fmt):
    """Each matrix packed in fmt at its own 128-byte-aligned byte address of one arena."""
    packed = [pack(np.ascontiguousarray(m), fmt).reshape(-1).view(np.uint8) for m in mats]
    addresses, size = [], 0
    for p in packed:
        addresses.append(size)
        size += -(-p.nbytes // 128) * 128
    arena = np.zeros(size, np.uint8)
    for a, p in zip(addresses, packed, strict=True):
        arena[a:a + p.nbytes] = p
    return arena, addresses


@pytest.mark.parametrize("fmt", [FMT_F32, FMT_BF16])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_the_block_matches_transformers(fmt, tokens):
    h, i, e, k = 64, 48, 6, 2
    cfg = GraniteMoeHybridConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k)
    torch.manual_seed(tokens)
    block = GraniteMoeHybridMoE(cfg).float()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    gu, dn = block.experts.gate_up_proj.detach().numpy(), block.experts.down_proj.detach().numpy()
    arena, addr = _arena([m for j in range(e) for m in (gu[j].T, dn[j].T)], fmt)
    # the weights as the card holds them (16-bit formats round): transformers on those values
    with torch.no_grad():
        for j in range(e):
            block.experts.gate_up_proj[j] = torch.from_numpy(unpack(pack(np.ascontiguousarray(gu[j].T), fmt),
                                                                    2 * i, fmt, h).T.copy())
            block.experts.down_proj[j] = torch.from_numpy(unpack(pack(np.ascontiguousarray(dn[j].T), fmt),
                                                                 h, fmt, i).T.copy())
    x = torch.randn(tokens, h)
    with torch.no_grad():
        want = block(x[None])[0].numpy()
    logits = (x @ block.router.weight.detach().T).numpy()
    ids, weights = np.empty((tokens, k), np.int32), np.empty((tokens, k), np.float32)
    moe_route(ids, weights, logits)
    order, starts = np.empty(tokens * k, np.int32), np.empty(e + 1, np.int32)
    moe_order(order, starts, ids)
    ws = lambda n: np.empty((tokens * k, n), np.float32)                    # noqa: E731
    out = np.full((tokens, h), np.nan, np.float32)
    experts = np.array(addr, np.int64).reshape(e, 2)
    moe_experts_at(out, x.numpy(), weights, order, starts, ws(h), ws(2 * i), ws(i), ws(h), arena.view(np.float32),
                   arena.view(np.uint16), experts, np.array([fmt, fmt], np.int64), ACT_F32)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
