"""The vLLM Spyre plugin's scheduling and admission rules, as a mode (``--spyre-compat``).

The plugin (sendnn-inference, formerly vllm-spyre: its docs/contributing/scheduler.md,
docs/user_guide/supported_features and sendnn_inference/config/model_configs.yaml; the facts
are in docs/spyre-fidelity.md) schedules more strictly than our scheduler does by default. Under
``--spyre-compat`` the scheduler (server/sched/scheduler.py) consults a ``SpyreCompat`` at its
decision points, and ``check_settings`` / ``for_engine`` refuse at start what the plugin
would not run (ValueError with the numbers):

1. One prefill at a time, never in a step with decodes: a step is one prefill chunk of one
   sequence, or decodes only. A sequence that started its prefill finishes it before another
   is admitted; after a prefill step, a step with decodes to run decodes (two prefill steps in
   a row only when nothing decodes: the plugin's interleaving); a step that cannot prefill
   decodes, and one that cannot decode prefills (no idle step). ``order``, ``prefill_kind``.
2. Prefill chunks of a fixed size, ``--max-num-batched-tokens`` (512 by default), a multiple of
   the 64-token KV block (``--block-size`` must be 64): a prefill step computes one whole
   chunk, from position 0 on chunk boundaries, only the prompt's last one shorter (the plugin
   pads a prompt on the left to whole chunks, so its first chunk is the short one; the
   number of chunks is the same). A chunk never shrinks to the free KV blocks: the scheduler
   preempts or waits instead.
3. Batch x max context <= 131,072 (``MAX_BATCH_TKV``, the plugin's VLLM_DT_MAX_BATCH_TKV_LIMIT for
   its 8B models at TP 4): checked when a sequence is admitted, over every future step
   (``fits_volume``), and at start for ``--max-num-seqs`` x ``--max-model-len``.
4. 32K context at most (``MAX_CONTEXT``): a longer ``--max-model-len`` (given or the model's)
   is refused at start, so a request over it is a 400 (server/sched/admission.py).
5. Only warmed-up shapes: every step program is prepared at start-up, so ``--no-warmup`` is
   refused (``spyre_compiles_after_warmup`` in /metrics stays 0).
6. Prefix-cache hits in whole chunks: a cached prefix is used in multiples of the chunk size
   (``whole_chunks``); the chunk that straddles the cache's end is computed again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:           # settings.py imports this module: it stays light
    from spyre_serve.server.sched.sequence import Sequence

KV_BLOCK = 64               # the plugin's KV block, in tokens; prefill chunks are multiples of it
MAX_CONTEXT = 32 * 1024     # the longest context the plugin serves with continuous batching
MAX_BATCH_TKV = 131_072     # batch size x max context, the plugin's VLLM_DT_MAX_BATCH_TKV_LIMIT


def check_volume(max_num_seqs: int, max_model_len: int, limit: int = MAX_BATCH_TKV) -> None:
    """``max_num_seqs`` sequences of ``max_model_len`` tokens fit the plugin's volume limit."""
    if max_num_seqs * max_model_len > limit:
        raise ValueError(
            f"--spyre-compat: --max-num-seqs {max_num_seqs} x --max-model-len {max_model_len} = "
            f"{max_num_seqs * max_model_len} tokens of KV volume, over the plugin's limit of {limit} "
            f"(batch x max context): give --max-num-seqs {max(1, limit // max_model_len)} or "
            f"--max-model-len {limit // max_num_seqs} or less")


def check_context(max_model_len: int, what: str = "--max-model-len") -> None:
    """``max_model_len`` is within the plugin's 32K context."""
    if max_model_len > MAX_CONTEXT:
        raise ValueError(f"--spyre-compat: {what} {max_model_len} is over the plugin's context of "
                         f"{MAX_CONTEXT} tokens: give --max-model-len {MAX_CONTEXT} or less")


def check_settings(s) -> None:
    """What ``s`` (server.launch.settings.Settings, with --spyre-compat) must hold before a model is
    loaded: a chunk (--max-num-batched-tokens) a multiple of 64, --block-size 64, warm-up on,
    and a --max-model-len, when given, within the context and volume limits."""
    chunk = s.max_num_batched_tokens
    if chunk % KV_BLOCK:
        lower = max(KV_BLOCK, chunk // KV_BLOCK * KV_BLOCK)
        raise ValueError(f"--spyre-compat: --max-num-batched-tokens {chunk} is the prefill chunk "
                         f"size, which must be a multiple of {KV_BLOCK} (the KV block): "
                         f"give {lower} or {lower + KV_BLOCK}")
    if s.block_size != KV_BLOCK:
        raise ValueError(f"--spyre-compat: --block-size {s.block_size}: the plugin's KV blocks "
                         f"are {KV_BLOCK} tokens")
    if not s.warmup:
        raise ValueError("--spyre-compat runs only warmed-up shapes: every step program is "
                         "prepared at start-up, so --no-warmup is refused")
    if s.max_model_len is not None:
        check_context(s.max_model_len)
        check_volume(s.max_num_seqs, s.max_model_len)


def for_engine(s, runner) -> SpyreCompat | None:
    """The policy an engine of ``s`` (Settings) over ``runner`` schedules with, None without
    --spyre-compat; refuses (ValueError) a context the runner resolved (the model's, capped by
    the KV cache) over the plugin's limits."""
    if not s.spyre_compat:
        return None
    check_settings(s)
    check_context(runner.max_model_len, "the context (the model's, capped by the KV cache)")
    check_volume(s.max_num_seqs, runner.max_model_len)
    return SpyreCompat(s.max_num_batched_tokens, runner.block_size)


@dataclass(slots=True)
class SpyreCompat:
    """The plugin's rules at the scheduler's decision points (the module's docstring)."""

    chunk: int                          # prefill tokens of one step: --max-num-batched-tokens
    block_size: int = KV_BLOCK
    max_batch_tkv: int = MAX_BATCH_TKV
    last_prefill: bool = False          # the last step scheduled was a prefill

    def __post_init__(self) -> None:
        if self.chunk <= 0 or self.chunk % self.block_size:
            raise ValueError(f"the prefill chunk ({self.chunk} tokens) must be a positive multiple "
                             f"of the KV block ({self.block_size})")

    def order(self, decoding: bool) -> tuple[str, str]:
        """The kinds of step to try, in order (the first that schedules anything is the step):
        a prefill first, unless the last step was one and some sequence ``decoding`` waits."""
        return ("decode", "prefill") if self.last_prefill and decoding else ("prefill", "decode")

    @staticmethod
    def prefill_kind(seq: Sequence, remaining: int) -> bool:
        """Whether computing ``remaining`` tokens of ``seq`` is a prefill: prompt tokens (the
        last one alone too), or several (a preempted sequence's recompute)."""
        return remaining > 1 or seq.num_computed < seq.num_prompt

    def whole_chunks(self, hit: list[int]) -> list[int]:
        """The cached blocks ``hit`` cut to whole chunks."""
        per_chunk = self.chunk // self.block_size
        return hit[:len(hit) // per_chunk * per_chunk]

    def fits_volume(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Whether admitting ``seq`` beside ``running`` keeps batch size x max context within
        ``max_batch_tkv`` at every future step, each sequence growing a token a step to its
        prompt + max_tokens and leaving then (the plugin's forward-looking check): the volume
        peaks just before one leaves, so each such step is checked."""
        spans = [(s.num_tokens, max(s.num_tokens, s.num_prompt + s.params.max_tokens))
                 for s in (*running, seq)]
        for now, end in spans:
            t = end - now                                     # steps until this one leaves
            alive = [n + t for n, e in spans if e - n >= t]   # contexts of those still there
            if len(alive) * max(alive) > self.max_batch_tkv:
                return False
        return True
