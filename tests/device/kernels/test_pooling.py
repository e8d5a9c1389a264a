"""pool_rows against a numpy reference: last, mean and first rows, normalized or not, and a
bucket's padding sequences (no rows) pooled to zeros."""

from __future__ import annotations

import numpy as np
import pytest

from spyre_serve.device.kernels.pooling import POOL_CLS, POOL_LAST, POOL_MEAN, pool_rows


def reference(hidden, query_start, mode, normalize):
    out = np.zeros((len(query_start) - 1, hidden.shape[1]), np.float64)
    for s in range(len(query_start) - 1):
        rows = hidden[query_start[s]:query_start[s + 1]].astype(np.float64)
        if len(rows) == 0:
            continue
        v = {POOL_LAST: rows[-1], POOL_MEAN: rows.mean(0), POOL_CLS: rows[0]}[mode]
        out[s] = v / np.linalg.norm(v) if normalize else v
    return out.astype(np.float32)


@pytest.mark.parametrize("mode", [POOL_LAST, POOL_MEAN, POOL_CLS])
@pytest.mark.parametrize("normalize", [0, 1])
def test_pool_rows_matches_numpy(mode, normalize):
    rng = np.random.default_rng(mode * 2 + normalize)
    hidden = rng.standard_normal((13, 24)).astype(np.float32)
    query_start = np.array([0, 1, 6, 11, 11, 11], np.int32)   # lengths 1, 5, 5, then padding
    out = np.full((5, 24), np.nan, np.float32)
    pool_rows(out, hidden, query_start, mode, normalize)
    np.testing.assert_allclose(out, reference(hidden, query_start, mode, normalize), rtol=1e-6, atol=1e-6)
    assert not out[3:].any()


def test_pool_rows_refuses_rows_out_of_range():
    out = np.zeros((1, 4), np.float32)
    with pytest.raises(ValueError, match="out of range"):
        pool_rows(out, np.zeros((3, 4), np.float32), np.array([0, 5], np.int32), POOL_MEAN, 1)
