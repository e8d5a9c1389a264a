"""The draw of one row: temperature, min_p, top_k, top_p, then one draw from what remains.

No full sort of the vocabulary: top-k is a quickselect, top-p a mass-weighted quickselect,
both O(V) expected and both run on the survivors of an exact O(V) prefilter (top-k: the
smallest of k chunk maxima bounds the k-th largest value from below; top-p: tokens lighter
than (1 - top_p) of the mass spread over all candidates are never needed). exp is
`exp_nonpos`, a polynomial that vectorizes. Ties at a top_k boundary are broken arbitrarily
but deterministically; tokens whose probability is below e^-87 of the top one (float32
underflow) are never drawn.
"""

import numpy as np
from numba import njit

from spyre_serve.device.kernels.fastexp import exp_nonpos
from spyre_serve.device.kernels.sampling.rng import uniform

_LOG_UNDERFLOW = np.float32(-87.0)  # exp_nonpos gives 0 below this


@njit(nogil=True, cache=True, fastmath=True)
def _sum(x):
    """Sum of float32[n] in float64 (vectorized)."""
    s = 0.0
    for i in range(x.shape[0]):
        s += x[i]
    return s


_LANES = 16       # partial maxima kept apart: LLVM makes the lane loop one vector compare


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _max_lanes(x, acc):
    """Largest value of a non-empty float32[n], acc float32[_LANES] scratch. A max over one
    running value is a chain of dependent compares (56 us at 49,152 values); over _LANES
    running values the lane loop is one vector compare (10 us)."""
    n = x.shape[0]
    acc[:] = x[0]
    whole = n // _LANES * _LANES
    for i in range(0, whole, _LANES):
        for j in range(_LANES):
            v = x[i + j]
            acc[j] = v if v > acc[j] else acc[j]
    m = acc[0]
    for j in range(1, _LANES):
        m = acc[j] if acc[j] > m else m
    for i in range(whole, n):
        m = x[i] if x[i] > m else m
    return m


@njit(nogil=True, cache=True)
def _max(x):
    """Largest value of a non-empty float32[n]."""
    return _max_lanes(x, np.empty(_LANES, np.float32))


@njit(nogil=True, cache=True, fastmath=True)
def log_sum_exp(row, w):
    """log(sum(exp(row))) of float32[V]; w float32[V] scratch."""
    mx = _max(row)
    for i in range(row.shape[0]):
        w[i] = row[i] - mx
    exp_nonpos(w)
    return mx + np.float32(np.log(_sum(w)))


_BLOCK = 256      # argmax: a vectorized max a block, then one scan of the winning block


@njit(nogil=True, cache=True)
def argmax(z):
    """(index, value) of the first largest element of float32[n]: the first block whose max
    is largest (strictly larger than every block before it), then its first element of that
    value (49,152 values: 55 -> ~12 us)."""
    n = z.shape[0]
    acc = np.empty(_LANES, np.float32)
    best = _max_lanes(z[:min(n, _BLOCK)], acc)
    first = 0
    for b0 in range(_BLOCK, n, _BLOCK):
        bm = _max_lanes(z[b0:min(n, b0 + _BLOCK)], acc)
        if bm > best:
            best = bm
            first = b0
    for i in range(first, min(n, first + _BLOCK)):
        if z[i] == best:
            return i, best
    return first, z[first]      # unordered values (NaN): the block's first


@njit(nogil=True, cache=True)
def _partition3(vals, idx, lo, hi, pivot):
    """Rearrange vals[lo:hi] (and idx alongside) into [> pivot][== pivot][< pivot].

    Returns (a, b): the == block is [a, b)."""
    lt = lo
    i = lo
    gt = hi
    while i < gt:
        v = vals[i]
        if v > pivot:
            vals[i], vals[lt] = vals[lt], v
            idx[i], idx[lt] = idx[lt], idx[i]
            lt += 1
            i += 1
        elif v < pivot:
            gt -= 1
            vals[i], vals[gt] = vals[gt], v
            idx[i], idx[gt] = idx[gt], idx[i]
        else:
            i += 1
    return lt, gt


@njit(nogil=True, cache=True)
def _median3(vals, lo, hi):
    a = vals[lo]
    b = vals[(lo + hi) // 2]
    c = vals[hi - 1]
    return max(min(a, b), min(max(a, b), c))


@njit(nogil=True, cache=True)
def _select_largest(vals, idx, n, k):
    """Rearrange vals[:n] (idx alongside) so that vals[:k] are the k largest; 0 < k <= n."""
    lo = 0
    hi = n
    while True:  # invariant: lo < k <= hi, [:lo] >= [lo:hi] >= [hi:n]
        a, b = _partition3(vals, idx, lo, hi, _median3(vals, lo, hi))
        if k <= a:
            hi = a
        elif k <= b:
            return
        else:
            lo = b


@njit(nogil=True, cache=True)
def _top_p_count(w, idx, n, target):
    """Rearrange w[:n] (idx alongside) so its c largest come first, where c is the
    smallest count whose mass reaches target (> 0); returns c."""
    lo = 0
    hi = n
    acc = 0.0  # mass of w[:lo], always < target; the answer is in (lo, hi]
    while hi - lo > 1:
        pivot = _median3(w, lo, hi)
        a, b = _partition3(w, idx, lo, hi, pivot)
        s_gt = 0.0
        for j in range(lo, a):
            s_gt += w[j]
        if acc + s_gt >= target:
            hi = a
            continue
        s_eq = (b - a) * np.float64(pivot)
        if acc + s_gt + s_eq >= target:
            need = int(np.ceil((target - acc - s_gt) / pivot))
            return a + min(max(need, 1), b - a)
        acc += s_gt + s_eq
        lo = b
    return hi


@njit(nogil=True, cache=True)
def top_raw(out_ids, out_lp, row, lse):
    """The K largest of row (ties: lower id first), most likely first, as logprobs."""
    k = out_ids.shape[0]
    if k == 0:
        return
    n = 0
    for i in range(row.shape[0]):
        x = row[i]
        if n == k and x <= row[out_ids[k - 1]]:
            continue
        j = n if n < k else k - 1  # insertion point search from the end
        while j > 0 and row[out_ids[j - 1]] < x:
            if j < k:
                out_ids[j] = out_ids[j - 1]
            j -= 1
        out_ids[j] = i
        if n < k:
            n += 1
    for j in range(k):
        if j < n:
            out_lp[j] = row[out_ids[j]] - lse
        else:  # K > V
            out_ids[j] = -1
            out_lp[j] = -np.inf


@njit(nogil=True, cache=True)
def draw(z, temperature, top_k, top_p, min_p, seed, counter, w, idx):
    """One row: returns the sampled token id. z float32[V]: the logits, penalized and
    banned; w float32[V], idx, bits int32[V] scratch."""
    v_n = z.shape[0]
    arg, zmax = argmax(z)
    if temperature <= 0.0 or top_k == 1:
        return arg
    inv_t = np.float32(1.0) / temperature
    cut = _LOG_UNDERFLOW
    if min_p > 0.0:
        cut = max(cut, np.float32(np.log(min_p)))
    n = 0
    if 0 < top_k < v_n:
        # Prefilter: split into top_k chunks; the smallest chunk maximum is a lower
        # bound of the top_k-th largest value, so everything below it is out.
        width = v_n // top_k
        bound = zmax
        acc = np.empty(_LANES, np.float32)          # one scratch for every chunk's maximum
        for c in range(top_k):
            bound = min(bound, _max_lanes(z[c * width:(c + 1) * width], acc))
        m = 0
        for i in range(v_n):
            if z[i] >= bound:
                w[m] = z[i]
                idx[m] = i
                m += 1
        _select_largest(w, idx, m, top_k)
        for j in range(top_k):
            e = (w[j] - zmax) * inv_t
            if e >= cut:
                w[n] = e
                idx[n] = idx[j]
                n += 1
    else:
        for i in range(v_n):
            e = (z[i] - zmax) * inv_t
            if e >= cut:
                w[n] = e
                idx[n] = i
                n += 1
    exp_nonpos(w[:n])
    if top_p < 1.0:
        total = 0.0
        for j in range(n):
            total += w[j]
        # Prefilter: tokens at or below a weight x hold at most n * x of the mass, so
        # below (1 - top_p) * total / n none of them is needed to reach top_p.
        bound = np.float32(0.999 * (1.0 - top_p) * total / n)
        m = 0
        for j in range(n):
            if w[j] >= bound:
                w[m] = w[j]
                idx[m] = idx[j]
                m += 1
        n = _top_p_count(w, idx, m, top_p * total)
    total = 0.0
    for j in range(n):
        total += w[j]
    u = uniform(seed, counter) * total
    acc = 0.0
    for j in range(n):
        acc += w[j]
        if acc > u:
            return idx[j]
    return arg  # not reached: acc ends at total > u
