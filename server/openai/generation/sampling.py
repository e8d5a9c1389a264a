"""An OpenAI request's sampling fields as the engine's ``GenerationParams``, one per choice.

A value the request leaves unset is the model's default (its generation_config.json, as
vLLM's ``--generation-config auto``: ``generation_defaults``), else the engine's neutral one
(temperature 1, no top-k, top-p 1, min-p 0, repetition penalty 1); a top-k at least the
vocabulary's size is off too (it keeps every token, as off does: vLLM takes any top-k, the
step program an int32); choice ``i`` of a seeded request gets seed ``seed + i`` (wrapped to 64
bits), so the ``n`` choices differ and each is reproducible.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from spyre_serve.models import SamplingParams
from spyre_serve.server.openai.generation.protocol import INT64, SamplingRequest
from spyre_serve.server.sched.sequence import GenerationParams

log = logging.getLogger("spyre_serve.api")

# The sampling fields generation_config.json may set, with the value a request that leaves one
# out gets otherwise (vLLM's ``get_diff_sampling_param``; ``max_new_tokens`` is ``max_tokens``).
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
# transformers' GenerationConfig defaults: vLLM reads the file's differences from them
# (``to_diff_dict``), so a value equal to one of these is no default of the model's.
HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
               "max_new_tokens": None}


def generation_defaults(model_path, source: str = "auto") -> dict:
    """vLLM's ``--generation-config``: "auto" reads the model directory's generation_config.json,
    "vllm" reads nothing, anything else is a directory to read it from. The sampling values it
    sets (temperature, top_p, top_k, min_p, repetition_penalty; ``max_new_tokens`` as
    ``max_tokens``), less those equal to transformers' defaults; {} when there is no file."""
    if source == "vllm":
        return {}
    folder = Path(model_path) if source == "auto" else Path(source)
    path = folder / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise ValueError(f"--generation-config {source}: no generation_config.json in it")
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a JSON file ({exc})") from None
    out = {}
    for key, hf_default in HF_DEFAULTS.items():
        value = config.get(key) if isinstance(config, dict) else None
        if value is None or value == hf_default or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out["max_tokens" if key == "max_new_tokens" else key] = int(value) if key in ("top_k", "max_new_tokens") \
            else float(value)
    if out:
        log.info("sampling defaults from %s (a request's own values win): %s", path, out)
    return out


def generation_params(req: SamplingRequest, max_tokens: int, logprobs: int | None, prompt_logprobs: bool,
                      vocab_size: int, prompt_top: int = 0, defaults: dict | None = None) -> list[GenerationParams]:
    """``req.n`` choices' parameters (``limits.check_limits`` has held ``n`` to ``--max-n``).
    ``logprobs``: None for none, else how many top alternatives each token lists; with
    ``prompt_logprobs`` the prompt is scored too, with ``prompt_top`` alternatives (the card
    computes max(logprobs, prompt_top) for both; the API layer lists each one's own number).
    ``defaults``: the model's (``generation_defaults``) for the fields the request leaves unset."""
    unset = {**NEUTRAL, **(defaults or {})}

    def value(name: str):
        v = getattr(req, name)
        return unset[name] if v is None else v

    top_k = max(0, value("top_k"))
    if top_k >= vocab_size:
        top_k = 0
    out = []
    for i in range(req.n):
        sampling = SamplingParams(
            temperature=value("temperature"),
            top_k=top_k,
            top_p=value("top_p"),
            min_p=value("min_p"),
            top_n_sigma=req.top_n_sigma,
            seed=None if req.seed is None else seed_of_choice(req.seed, i),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=value("repetition_penalty"),
            logprobs=max(logprobs or 0, prompt_top if prompt_logprobs else 0),
        )
        out.append(
            GenerationParams(
                sampling=sampling,
                max_tokens=max_tokens,
                min_tokens=min(req.min_tokens, max_tokens),
                stop=list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                cache_salt=req.cache_salt,
                priority=req.priority,
            )
        )
    return out


def seed_of_choice(seed: int, i: int) -> int:
    """Choice ``i``'s seed: ``seed + i``, wrapped into the 64-bit range the seed came in."""
    return (seed + i - INT64[0]) % 2**64 + INT64[0]
