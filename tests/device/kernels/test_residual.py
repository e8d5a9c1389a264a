import numpy as np
import pytest

from spyre_serve.device.kernels.residual import residual_add


@pytest.mark.parametrize("shape", [(1, 1), (3, 257), (2, 3, 5)])
def test_residual_add_scales_and_adds_in_place(shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32)
    y = rng.standard_normal(shape, dtype=np.float32)
    ref = x + np.float32(0.22) * y
    residual_add(x, y, 0.22)
    np.testing.assert_allclose(x, ref, rtol=1e-6, atol=1e-7)


def test_residual_add_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="residual_add"):
        residual_add(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32), 1.0)
