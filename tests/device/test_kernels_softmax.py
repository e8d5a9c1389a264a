import numpy as np
import pytest
import torch

from device.kernels.softmax import log_softmax, softmax

SHAPES = [(1, 1), (1, 49159), (7, 33)]


def _x(m, n):
    return np.random.default_rng(n).standard_normal((m, n), dtype=np.float32) * 10


@pytest.mark.parametrize("m,n", SHAPES)
def test_softmax_matches_torch(m, n):
    x = _x(m, n)
    out = np.full_like(x, np.nan)
    softmax(out, x)
    np.testing.assert_allclose(out, torch.softmax(torch.from_numpy(x), -1).numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("m,n", SHAPES)
def test_log_softmax_matches_torch(m, n):
    x = _x(m, n)
    out = np.full_like(x, np.nan)
    log_softmax(out, x)
    ref = torch.log_softmax(torch.from_numpy(x).double(), -1).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


def test_softmax_handles_large_logits_without_overflow():
    x = np.array([[1000.0, 999.0, -1000.0]], np.float32)
    out = np.empty_like(x)
    softmax(out, x)
    np.testing.assert_allclose(out, torch.softmax(torch.from_numpy(x), -1).numpy(), rtol=1e-6)
