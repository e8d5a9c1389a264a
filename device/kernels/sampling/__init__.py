"""On-device sampling, one file per concept:

    rows.py       sample_rows: the sampler of a step, one parameter record per row
    select.py     temperature, min_p, top_k, top_p and the draw (quickselects, no sort)
    penalties.py  vLLM's penalties from per-sequence tables; count_tokens fills them
    masks.py      bans, grammar bitmasks, top-n-sigma, logit bias
    rng.py        uniform(seed, counter): counter-based, so batch-position independent
"""

from spyre_serve.device.kernels.sampling.masks import (
    BANNED,
    add_logit_bias,
    apply_token_mask,
    top_n_sigma,
)
from spyre_serve.device.kernels.sampling.penalties import count_tokens, penalize_row
from spyre_serve.device.kernels.sampling.rng import uniform
from spyre_serve.device.kernels.sampling.rows import sample_rows

__all__ = ["BANNED", "add_logit_bias", "apply_token_mask", "count_tokens", "penalize_row",
           "sample_rows", "top_n_sigma", "uniform"]
