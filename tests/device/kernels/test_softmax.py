import numpy as np
import pytest
import torch

from spyre_serve.device.kernels.softmax import log_softmax

SHAPES = [(1, 1), (1, 49159), (7, 33)]


def _x(m, n):
    return np.random.default_rng(n).standard_normal((m, n), dtype=np.float32) * 10


@pytest.mark.parametrize("m,n", SHAPES)
def test_log_softmax_matches_torch(m, n):
    x = _x(m, n)
    out = np.full_like(x, np.nan)
    log_softmax(out, x)
    ref = torch.log_softmax(torch.from_numpy(x).double(), -1).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


def test_log_softmax_handles_large_logits_without_overflow():
    x = np.array([[1000.0, 999.0, -1000.0]], np.float32)
    out = np.empty_like(x)
    log_softmax(out, x)
    ref = torch.log_softmax(torch.from_numpy(x).double(), -1).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)   # float32 near 1000: ulp 6e-5


def test_log_softmax_gives_minus_inf_to_minus_inf_entries():
    x = np.array([[0.0, -np.inf, 1.0]], np.float32)
    out = np.empty_like(x)
    log_softmax(out, x)
    assert out[0, 1] == -np.inf
    np.testing.assert_allclose(np.exp(out[0, [0, 2]]), [1 / (1 + np.e), np.e / (1 + np.e)],
                               rtol=1e-6)


def test_log_softmax_in_place_matches_out_of_place():
    x = _x(3, 50)
    ref = np.empty_like(x)
    log_softmax(ref, x)
    log_softmax(x, x)
    np.testing.assert_array_equal(x, ref)
