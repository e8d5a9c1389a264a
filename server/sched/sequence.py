"""One generated sequence: its tokens, its place in the KV cache, how it stops.

A request with ``n`` choices owns ``n`` sequences. Counters follow nano-vllm
and vLLM v1: ``num_computed`` (tokens scheduled into the KV cache, including
steps still on the device) chases ``num_tokens`` (tokens known on the host
plus tokens sampled on the device but not yet read back, ``num_pending``).
Prefill, chunked prefill, decode and recompute after preemption are the same
arithmetic.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from spyre_serve.models import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class GenerationParams:
    """Everything the engine needs to know about one request's generation."""

    sampling: SamplingParams
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0..20: sampled token + top-n
    grammar: object | None = None  # server.structured_output.grammars.Grammar: structured output (each choice
    # gets its own matcher from it); its sequences never decode from_device
    prompt_logprobs: bool = False  # echo with logprobs, or prompt_logprobs: score the prompt too
    include_stop_str_in_output: bool = False  # keep the stop string (a stop token's text) in the text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared only within one salt
    priority: int = 0  # vLLM's: lower runs first under --scheduling-policy priority (server/sched/waiting.py)
    pooling: bool = False  # an embedding: its whole prompt in one step, pooled (max_tokens 0)
    lora: str | None = None  # the LoRA adapter it runs with (server/lora/adapters.py), None: the base model
    lora_id: int = 0  # that adapter's load: prefix-cache blocks are shared only within one

    @property
    def uses_penalties(self) -> bool:
        s = self.sampling
        return (
            s.presence_penalty != 0.0 or s.frequency_penalty != 0.0 or s.repetition_penalty != 1.0
        )

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether a sequence may start from cached KV blocks instead of position 0. Not
        with prompt logprobs (they need the logits of every prompt position: vLLM skips the
        cache for them too), nor with penalties (the card counts a sequence's prompt tokens
        into its penalty slot as it computes them, from position 0: models/step/penalty_slots.py)."""
        return not self.prompt_logprobs and not self.uses_penalties and not self.pooling


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of one token plus its top alternatives (id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # 1 + tokens above it in the distribution (prompt tokens; None: not known)


@dataclass(slots=True)
class Sequence:
    # Each group of fields has its writers, and no other module writes them (WRITERS below;
    # tests/server/sched/test_sequence_ownership.py reads every module's assignments to check it).
    # -- the request: set at creation, read by all
    seq_id: int
    request_id: str
    index: int  # choice index within the request
    prompt_ids: list[int]
    params: GenerationParams
    arrival: float
    # -- scheduling state: the scheduler (and its block manager)
    token_ids: list[int] = field(default_factory=list)  # prompt + output known on the host
    num_pending: int = 0  # tokens sampled by launched steps, not read back yet
    num_computed: int = 0  # tokens written (or being written) into the KV cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks of known tokens
    num_cached_blocks: int = 0  # leading blocks of block_table registered (or tried) in the cache
    kv_suspect: bool = False  # holds a cached block a failed step wrote: recompute from 0
    status: SeqStatus = SeqStatus.WAITING
    num_inflight: int = 0  # launched steps this sequence is part of, not collected yet
    release_pending: bool = False  # ended or preempted: release it once num_inflight is 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # -- how it ended: the open requests (which finish and fail them)
    stop_reason: int | str | None = None
    error: str | None = None
    # -- text, logprobs, grammar and timing: the output processor (and its stop checks)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""  # output text so far (cut before a stop string)
    detok: object | None = None  # models.checkpoints.tokenizer.IncrementalDetokenizer
    matcher: object | None = None  # server.structured_output.grammars.Matcher: its grammar, advanced per known token
    embedding: object | None = None  # float32[H] of a pooling sequence, once its step is read back
    first_token_time: float | None = None
    last_token_time: float | None = None
    projected: object | None = None  # engine_stats.ProjectedTimes: its steps on a real card
    # -- what the client has been sent: the updates (outputs.py)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    num_text_sent: int = 0  # characters of ``text`` already handed to the client
    num_tokens_sent: int = 0  # output tokens (and logprobs) already handed to the client
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if self.params.prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = [None] * len(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        """Output tokens known on the host."""
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the KV cache must eventually hold: known plus pending."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_generated_total(self) -> int:
        """Output tokens known or being sampled on the device."""
        return self.num_generated + self.num_pending

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def wants_more(self) -> bool:
        """True while another sampled token could still be used."""
        p = self.params
        return self.num_generated_total < p.max_tokens

    @property
    def stop_holdback(self) -> int:
        """Characters kept back while streaming: a stop string may still start in them (none
        when a stop string stays in the text: vLLM's stop buffer)."""
        if self.params.include_stop_str_in_output:
            return 0
        return max((len(s) for s in self.params.stop), default=1) - 1

    def append_text(self, delta: str) -> str | None:
        """Add detokenized text; return the stop string it completes, if any.

        The text is cut before the stop string, or after it with
        ``include_stop_str_in_output``. Only the tail that could hold a new match is
        searched, so a stop string spanning tokens is found once.
        """
        before = len(self.text)
        self.text += delta
        if not delta or not self.params.stop:
            return None
        if self.num_generated < self.params.min_tokens:
            return None
        longest = max(len(s) for s in self.params.stop)
        begin = max(0, before - longest + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            i = self.text.find(stop, begin)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        end = best[0] + len(best[1]) if self.params.include_stop_str_in_output else best[0]
        self.text = self.text[:end]
        return best[1]

    def take_text(self) -> str:
        """Text not yet sent, minus the holdback unless finished."""
        end = len(self.text) if self.is_finished else max(self.num_text_sent, len(self.text) - self.stop_holdback)
        delta = self.text[self.num_text_sent : end]
        self.num_text_sent = end
        return delta


# Who writes which fields of a Sequence (module paths below server/): every other module reads.
WRITERS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("token_ids", "num_pending", "num_computed", "block_table", "block_hashes", "num_cached_blocks",
     "kv_suspect", "status", "num_inflight", "release_pending", "finish_reason"):
        ("sched/scheduler.py", "sched/block_manager.py"),
    ("stop_reason", "error"): ("engine/open_requests.py",),
    ("output_logprobs", "text", "detok", "matcher", "embedding", "first_token_time", "last_token_time",
     "projected"):
        ("engine/output_processor.py", "engine/stopping.py", "engine/stats.py", "sched/sequence.py"),
    ("prompt_logprobs", "num_text_sent", "num_tokens_sent", "prompt_logprobs_sent"):
        ("engine/outputs.py", "sched/sequence.py"),
}
