import numpy as np
import pytest

from device.kernels.embedding import embedding


@pytest.mark.parametrize("t,v,h", [(1, 1, 1), (5, 11, 7), (33, 100, 384)])
def test_embedding_gathers_scaled_rows(t, v, h):
    rng = np.random.default_rng(t)
    table = rng.standard_normal((v, h), dtype=np.float32)
    ids = rng.integers(0, v, t).astype(np.int32)
    out = np.full((t, h), np.nan, np.float32)
    embedding(out, table, ids, 12.0)
    np.testing.assert_allclose(out, table[ids] * np.float32(12.0), rtol=1e-7)


def test_embedding_rejects_out_of_range_id():
    table = np.zeros((4, 2), np.float32)
    with pytest.raises(IndexError, match="out of range"):
        embedding(np.empty((2, 2), np.float32), table, np.array([1, 4], np.int32), 1.0)


def test_embedding_rejects_negative_id():
    table = np.zeros((4, 2), np.float32)
    with pytest.raises(IndexError, match="out of range"):
        embedding(np.empty((1, 2), np.float32), table, np.array([-1], np.int32), 1.0)
