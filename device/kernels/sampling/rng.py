"""The draw's random numbers: a counter-based hash, so a row's token depends only on (seed,
counter, logits, parameters), never on its position in the batch or on the other rows."""

import numpy as np
from numba import njit

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@njit(nogil=True, cache=True)
def splitmix64(x):
    """The splitmix64 finalizer of x + golden gamma; x, result uint64."""
    z = x + _GAMMA
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@njit(nogil=True, cache=True)
def uniform(seed, counter):
    """A float64 in [0, 1) from (seed uint64, counter int64), 53 random bits."""
    h = splitmix64(np.uint64(seed) ^ splitmix64(np.uint64(counter)))
    return np.float64(h >> np.uint64(11)) * (1.0 / 9007199254740992.0)
