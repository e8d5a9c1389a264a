import numpy as np

from spyre_serve.device.kernels.fastexp import exp_nonpos


def test_exp_nonpos_matches_exp_to_float32_precision():
    x = np.concatenate([-np.random.default_rng(0).random(10001).astype(np.float32) * 87,
                        np.array([0.0, -1e-8, -0.5, -86.9], np.float32)])
    y = x.copy()
    exp_nonpos(y)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(y - ref) / ref) < 5e-7


def test_exp_nonpos_of_zero_is_one():
    y = np.zeros(3, np.float32)
    exp_nonpos(y)
    assert y.tolist() == [1.0, 1.0, 1.0]


def test_exp_nonpos_flushes_below_minus_87_and_minus_inf_to_zero():
    y = np.array([-87.5, -1000.0, -np.inf], np.float32)
    exp_nonpos(y)
    assert y.tolist() == [0.0, 0.0, 0.0]
