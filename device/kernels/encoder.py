"""The kernels of a BERT-style encoder (RoBERTa, XLM-RoBERTa) that a decoder does not have.

    embed_rows(out, word, pos, type_row, tokens, positions)   out[t] = (word[tok] + type) + pos[p]
    layernorm(out, x, w, b, eps)       out[M, H] = (x - mean) / sqrt(var + eps) * w + b (out may be x)
    add_bias(x, b)                     x[M, N] += b[N], in place
    gelu(x)                            x = x * (1 + erf(x / sqrt 2)) / 2, in place (exact, not tanh)
    bidirectional_attention(out, q, k, v, query_start, scale)
                                       each sequence's rows attend to every row of the sequence

All float32, as transformers computes them in fp32 (LayerNorm's mean and biased variance in
two passes over the row). Each driver runs small work on the calling thread and spreads
larger work over the cores (device.abi.chunks_for), as device/kernels/norm.py does.
"""

import math

import numpy as np
from numba import njit, prange

from spyre_serve.device.abi import chunks_for, get_kernel_threads
from spyre_serve.device.kernels.softmax import _exp_shifted

# Reassociated sums (vectorized), but infinities and NaN keep their meaning.
_REORDER = {"reassoc", "contract", "nsz", "arcp", "afn"}
_Q_TILE = 32              # query rows of one attention work item (one sequence, one head)
_CHUNKS_PER_THREAD = 4    # attention work items are dealt round-robin to this many chunks a core


# ---- embeddings ------------------------------------------------------------------------------

@njit(nogil=True, cache=True)
def embed_rows(out, word, pos, type_row, tokens, positions):
    """out[T, H] = (word[tokens[t]] + type_row) + pos[positions[t]], in transformers' order
    (RobertaEmbeddings: word + token type, then + position); IndexError for a token or position
    outside its table."""
    t_n, h = out.shape
    if word.shape[1] != h or pos.shape[1] != h or type_row.shape[0] != h:
        raise ValueError("embed_rows: tables' widths differ from out's (word, pos, type, out)",
                         word.shape[1], pos.shape[1], type_row.shape[0], h)
    if tokens.shape[0] != t_n or positions.shape[0] != t_n:
        raise ValueError("embed_rows: tokens and positions must have T entries (tokens, "
                         "positions, T)", tokens.shape[0], positions.shape[0], t_n)
    for t in range(t_n):
        tok, p = tokens[t], positions[t]
        if tok < 0 or tok >= word.shape[0]:
            raise IndexError("embed_rows: token id outside the vocabulary (row, id, V)", t, tok,
                             word.shape[0])
        if p < 0 or p >= pos.shape[0]:
            raise IndexError("embed_rows: position outside the position table (row, position, "
                             "table rows)", t, p, pos.shape[0])
        for j in range(h):
            out[t, j] = (word[tok, j] + type_row[j]) + pos[p, j]


# ---- LayerNorm -------------------------------------------------------------------------------

@njit(nogil=True, cache=True, fastmath=_REORDER)
def _ln_rows(out, x, w, b, eps, r0, r1):
    h = x.shape[1]
    inv_h = np.float32(1.0) / np.float32(h)
    for i in range(r0, r1):
        xi, oi = x[i], out[i]
        s = np.float32(0.0)
        for j in range(h):
            s += xi[j]
        mean = s * inv_h
        ss = np.float32(0.0)
        for j in range(h):
            dv = xi[j] - mean
            ss += dv * dv
        r = np.float32(1.0) / np.sqrt(ss * inv_h + np.float32(eps))
        _ln_scale(oi, xi, mean, r, w, b)


@njit(nogil=True, cache=True)
def _ln_scale(oi, xi, mean, r, w, b):
    """oi = (xi - mean) r w + b, in IEEE order (no fast-math flags: not regrouped or fused), so
    that the vector loop and the scalar one LLVM takes when oi is xi (its alias check) give the
    same bits: under _ln_rows' reordering the two differed in the last bit, in place against
    not (seen: a fresh compile agreed, the same code loaded from Numba's cache did not)."""
    for j in range(xi.shape[0]):
        oi[j] = (xi[j] - mean) * r * w[j] + b[j]


@njit(nogil=True, cache=True, parallel=True)
def _ln_parallel(out, x, w, b, eps, chunks):
    m = x.shape[0]
    for c in prange(chunks):
        _ln_rows(out, x, w, b, eps, c * m // chunks, (c + 1) * m // chunks)


@njit(nogil=True, cache=True)
def layernorm(out, x, w, b, eps):
    """out[M, H] = (x - mean) / sqrt(var + eps) * w[H] + b[H] per row of x[M, H] (biased
    variance, as torch's LayerNorm); out may be x."""
    m, h = x.shape
    if out.shape[0] != m or out.shape[1] != h:
        raise ValueError("layernorm: out shape differs from x shape (rows, cols)", m, h)
    if w.shape[0] != h or b.shape[0] != h:
        raise ValueError("layernorm: weight and bias length differ from hidden size (w, b, H)",
                         w.shape[0], b.shape[0], h)
    chunks = chunks_for(m, m * h)
    if chunks == 1:
        _ln_rows(out, x, w, b, eps, 0, m)
    else:
        _ln_parallel(out, x, w, b, eps, chunks)


# ---- bias and GELU ---------------------------------------------------------------------------

@njit(nogil=True, cache=True)
def _bias_rows(x, b, r0, r1):
    n = x.shape[1]
    for i in range(r0, r1):
        xi = x[i]
        for j in range(n):
            xi[j] += b[j]


@njit(nogil=True, cache=True, parallel=True)
def _bias_parallel(x, b, chunks):
    m = x.shape[0]
    for c in prange(chunks):
        _bias_rows(x, b, c * m // chunks, (c + 1) * m // chunks)


@njit(nogil=True, cache=True)
def add_bias(x, b):
    """x[M, N] += b[N], in place (a linear layer's bias after its GEMM)."""
    m, n = x.shape
    if b.shape[0] != n:
        raise ValueError("add_bias: bias length differs from the columns (bias, N)", b.shape[0], n)
    chunks = chunks_for(m, m * n)
    if chunks == 1:
        _bias_rows(x, b, 0, m)
    else:
        _bias_parallel(x, b, chunks)


@njit(nogil=True, cache=True)
def _gelu_span(xf, i0, i1):
    half = np.float32(0.5)
    one = np.float32(1.0)
    inv_sqrt2 = np.float32(1.0 / math.sqrt(2.0))
    for i in range(i0, i1):
        v = xf[i]
        xf[i] = v * half * (one + np.float32(math.erf(v * inv_sqrt2)))


@njit(nogil=True, cache=True, parallel=True)
def _gelu_parallel(xf, chunks):
    n = xf.shape[0]
    for c in prange(chunks):
        _gelu_span(xf, c * n // chunks, (c + 1) * n // chunks)


@njit(nogil=True, cache=True)
def gelu(x):
    """x = x / 2 * (1 + erf(x / sqrt(2))), in place over a C-contiguous array of any rank
    (transformers' "gelu", the exact one; erf in float32)."""
    xf = x.reshape(x.size)
    n = xf.shape[0]
    chunks = chunks_for(n, 8 * n)          # erf costs several multiply-adds an element
    if chunks == 1:
        _gelu_span(xf, 0, n)
    else:
        _gelu_parallel(xf, chunks)


# ---- attention -------------------------------------------------------------------------------

@njit(nogil=True, cache=True, inline="always")
def _axpy(y, a, x, n):
    """y[:n] += a * x[:n]."""
    for j in range(n):
        y[j] += a * x[j]


@njit(nogil=True, cache=True, fastmath=_REORDER)
def _attend(out, q, k, v, h, s0, n, r0, r1, sc, kt, vh, qb, sbuf, acc):
    """Rows r0..r1-1 of the sequence whose rows are s0..s0+n-1, query head h, against all of
    its n keys. Scratch: kt [D, >= n] (K^T of the head, so the scores run along the keys),
    vh [>= n, D], qb, acc [D], sbuf [>= n]."""
    d = q.shape[2]
    for j in range(n):
        for i in range(d):
            kt[i, j] = k[s0 + j, h, i]
            vh[j, i] = v[s0 + j, h, i]
    scores = sbuf[:n]
    for r in range(r0, r1):
        for i in range(d):
            qb[i] = q[r, h, i] * sc
        scores[:] = 0.0
        for i in range(d):
            _axpy(scores, qb[i], kt[i], n)
        _exp_shifted(scores, scores)            # exp(score - max), in place
        total = np.float32(0.0)
        for j in range(n):
            total += scores[j]
        acc[:] = 0.0
        for j in range(n):
            _axpy(acc, scores[j], vh[j], d)
        inv = np.float32(1.0) / total
        for i in range(d):
            out[r, h, i] = acc[i] * inv


@njit(nogil=True, cache=True)
def _attend_items(out, q, k, v, query_start, sc, c, step, longest):
    """Work items c, c + step, ... of the (sequence, tile of _Q_TILE query rows, head) triples
    in that order, with scratch for sequences of up to `longest` rows."""
    hq, d = q.shape[1], q.shape[2]
    kt = np.empty((d, longest), np.float32)
    vh = np.empty((longest, d), np.float32)
    qb = np.empty(d, np.float32)
    acc = np.empty(d, np.float32)
    sbuf = np.empty(longest, np.float32)
    item = 0
    for s in range(query_start.shape[0] - 1):
        s0, s1 = query_start[s], query_start[s + 1]
        for r0 in range(s0, s1, _Q_TILE):
            for h in range(hq):
                if item % step == c:
                    _attend(out, q, k, v, h, s0, s1 - s0, r0, min(r0 + _Q_TILE, s1), sc, kt, vh,
                            qb, sbuf, acc)
                item += 1


@njit(nogil=True, cache=True, parallel=True)
def _attend_parallel(out, q, k, v, query_start, sc, chunks, longest):
    for c in prange(chunks):
        _attend_items(out, q, k, v, query_start, sc, c, chunks, longest)


@njit(nogil=True, cache=True)
def bidirectional_attention(out, q, k, v, query_start, scale):
    """out[T, Hq, D] = softmax(q k^T * scale) v within each sequence, no mask: the rows
    query_start[s]..query_start[s+1]-1 of sequence s attend to every row of s and to no other.
    q, k, v: [T, Hq, D] float32 of any strides (views of a fused QKV projection); softmax
    stable (the row's maximum subtracted, softmax.py's exponentials).
    Rows outside every sequence (past query_start[S]: a bucket's padding) are set to zero, so
    that what follows them stays finite and never reaches a sequence's rows.
    Work items, in parallel: (a sequence, a tile of _Q_TILE of its query rows, a head), dealt
    round-robin to chunks, each with that head's K^T and V of the sequence copied once into
    contiguous scratch."""
    t_n, hq, d = q.shape
    s_n = query_start.shape[0] - 1
    if out.shape != q.shape or k.shape != q.shape or v.shape != q.shape:
        raise ValueError("bidirectional_attention: out, q, k, v must all be [T, Hq, D] (T, Hq, D)",
                         t_n, hq, d)
    if s_n < 0 or (s_n > 0 and query_start[0] != 0) or (s_n > 0 and query_start[s_n] > t_n):
        raise ValueError("bidirectional_attention: query_start must start at 0 and end within T "
                         "(entries, T)", query_start.shape[0], t_n)
    longest, items, pairs = 1, 0, 0
    for s in range(s_n):
        n = query_start[s + 1] - query_start[s]
        if n < 0:
            raise ValueError("bidirectional_attention: query_start decreases at sequence (seq, "
                             "first, end)", s, query_start[s], query_start[s + 1])
        longest = max(longest, n)
        items += (n + _Q_TILE - 1) // _Q_TILE * hq
        pairs += n * n
    for r in range(query_start[s_n] if s_n > 0 else 0, t_n):     # a bucket's padding rows
        out[r] = 0.0
    sc = np.float32(scale)
    chunks = min(items, _CHUNKS_PER_THREAD * get_kernel_threads())
    if chunks_for(items, pairs * hq * d) == 1 or chunks < 2:
        _attend_items(out, q, k, v, query_start, sc, 0, 1, longest)
    else:
        _attend_parallel(out, q, k, v, query_start, sc, chunks, longest)
