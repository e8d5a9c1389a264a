import numpy as np
import pytest
import torch

from spyre_serve.device.kernels.norm import rmsnorm


def _reference(x, w, eps):
    # transformers' GraniteRMSNorm / LlamaRMSNorm
    xt = torch.from_numpy(x)
    var = xt.pow(2).mean(-1, keepdim=True)
    return (torch.from_numpy(w) * (xt * torch.rsqrt(var + eps))).numpy()


@pytest.mark.parametrize("m,h", [(1, 1), (1, 384), (5, 257), (64, 4096)])
def test_rmsnorm_matches_transformers(m, h):
    rng = np.random.default_rng(m * 1000 + h)
    x = rng.standard_normal((m, h), dtype=np.float32) * 3
    w = rng.standard_normal(h, dtype=np.float32)
    out = np.full_like(x, np.nan)
    rmsnorm(out, x, w, 1e-5)
    np.testing.assert_allclose(out, _reference(x, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_rmsnorm_eps_dominates_zero_row():
    x = np.zeros((1, 8), np.float32)
    out = np.full_like(x, np.nan)
    rmsnorm(out, x, np.ones(8, np.float32), 1e-5)
    assert np.all(out == 0)


def test_rmsnorm_rejects_wrong_weight_length():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="weight length"):
        rmsnorm(np.empty_like(x), x, np.ones(7, np.float32), 1e-5)
