"""Where a layer's LoRA adapters sit in the arena, and the step's call that applies them.

Each layer has one block of float32 in the adapter arena (models/lora/arena.py places it),
holding NSLOT adapter slots of rank R (an adapter of rank r_s fills its first r_s rows; the
kernel reads only those):

    scales   [MODULES, NSLOT]        a module an adapter does not target: scale 0 (skipped)
    ranks    [NSLOT]                 each slot's adapter's rank r_s <= R (a float)
    per module m, in MODULES order:
      A_m    [NSLOT, R, K_m]         lora_A.weight of each slot, its first r_s rows (shrink)
      B_m    [NSLOT, R, N_m]         lora_B.weight.T, its first r_s rows (expand)

each part starting on a 128-byte stick. K_m, N_m are the module's input and output widths
(`module_dims`). The layer table holds the block's address, R and NSLOT (models/step/weights.py);
`lora_layer` applies the modules of one projection to its output: the fused QKV's q, k and v
and the fused gate/up's gate and up each to their own columns of it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from spyre_serve.device.abi import f32_at
from spyre_serve.device.kernels.lora import lora_modules_at

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
N_MODULES = len(MODULES)
# The projections of the step, as [first, end) ranges of MODULES, side by side in the output.
ON_QKV, ON_O, ON_GATE_UP, ON_DOWN = (0, 3), (3, 4), (4, 6), (6, 7)
_STICK_FLOATS = 32


@njit(nogil=True, cache=True)
def module_dims(m, h, qd, kd, inter):
    """(input width, output width) of module m of MODULES."""
    if m == 0:
        return h, qd
    if m == 1 or m == 2:
        return h, kd
    if m == 3:
        return qd, h
    if m == 4 or m == 5:
        return h, inter
    return inter, h


@njit(nogil=True, cache=True)
def _up(n):
    return -(-n // _STICK_FLOATS) * _STICK_FLOATS


@njit(nogil=True, cache=True)
def block_offsets(h, qd, kd, inter, rank, nslot):
    """int64[2 * N_MODULES + 2]: float offsets in a layer's block of the scales (0; the ranks
    follow them, at N_MODULES * nslot), of each module's A then B, and (last) the block's
    length in floats."""
    out = np.zeros(2 * N_MODULES + 2, np.int64)
    at = _up((N_MODULES + 1) * nslot)
    for m in range(N_MODULES):
        k, n = module_dims(m, h, qd, kd, inter)
        out[1 + 2 * m] = at
        at += _up(nslot * k * rank)
        out[2 + 2 * m] = at
        at += _up(nslot * rank * n)
    out[2 * N_MODULES + 1] = at
    return out


@njit(nogil=True, cache=True)
def lora_layer(y, x, f32, lora, slots, first, end, h, qd, kd, inter):
    """y += each slot's update of modules first..end-1 (their outputs side by side in y);
    `lora` is the layer table's (block address, rank, slots); address 0: no adapters."""
    base, rank, nslot = lora[0], lora[1], lora[2]
    if base == 0:
        return
    offs = block_offsets(h, qd, kd, inter, rank, nslot)
    modules = np.empty((end - first, 6), np.int64)
    col0 = 0
    for m in range(first, end):
        k, n = module_dims(m, h, qd, kd, inter)
        modules[m - first] = (base + 4 * offs[1 + 2 * m], base + 4 * offs[2 + 2 * m], base + 4 * m * nslot,
                              k, n, col0)
        col0 += n
    ranks = f32_at(f32, base + 4 * N_MODULES * nslot, nslot)
    lora_modules_at(y, x, f32, modules, ranks, slots, nslot, rank)
