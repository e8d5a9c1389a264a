import numpy as np
import pytest
import torch

from spyre_serve.device.kernels.activation import swiglu


@pytest.mark.parametrize("t,i", [(1, 1), (3, 37), (16, 1280)])
def test_swiglu_matches_torch_silu_times_up(t, i):
    gu = np.random.default_rng(i).standard_normal((t, 2 * i), dtype=np.float32) * 4
    out = np.full((t, i), np.nan, np.float32)
    swiglu(out, gu)
    g = torch.from_numpy(gu)
    ref = (torch.nn.functional.silu(g[:, :i]) * g[:, i:]).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_swiglu_rejects_out_of_wrong_width():
    with pytest.raises(ValueError, match="swiglu"):
        swiglu(np.empty((2, 3), np.float32), np.zeros((2, 8), np.float32))


def test_swiglu_saturates_without_overflow_at_extreme_gates():
    gu = np.array([[-200.0, -30.0, 0.0, 30.0, 200.0, 2.0, 2.0, 2.0, 2.0, 2.0]], np.float32)
    out = np.empty((1, 5), np.float32)
    swiglu(out, gu)
    np.testing.assert_allclose(out[0], [0.0, -30.0 * 2 * np.exp(-30.0), 0.0, 60.0, 400.0],
                               rtol=1e-5, atol=1e-30)
