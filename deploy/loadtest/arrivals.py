"""When requests are sent: gaps between arrivals, as `vllm bench serve` draws them.

At a rate of R requests/s with burstiness B, the gap before each request is
drawn from a gamma distribution of shape B and scale 1 / (R * B): its mean is
1 / R whatever B is; B = 1 gives Poisson arrivals (exponential gaps), B < 1
burstier traffic (coefficient of variation 1 / sqrt(B) > 1), B > 1 more even
traffic. An infinite rate sends every request at once (then only the
concurrency limit paces them).
"""

from __future__ import annotations

import math
import random


def arrival_gaps(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """``n`` gaps in seconds: the wait before each request (the first included)."""
    if n < 0:
        raise ValueError(f"the number of requests must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(n)]
