"""What a step carries: the scheduler's chunks (``ScheduledChunk``), the ``SeqWork`` the engine
hands the runner for each (``models/step/interface.py``, the boundary between the server and the
model), and the launched ``Step`` the engine reads back."""

from __future__ import annotations

from dataclasses import dataclass, field

from spyre_serve.models import SamplingParams, SeqWork
from spyre_serve.server.engine.seams import PendingStep
from spyre_serve.server.engine.stopping import banned_tokens
from spyre_serve.server.sched.sequence import Sequence


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # tokens of seq already in the KV cache
    num_new: int  # tokens computed this step
    sample: bool  # sample the next token after this chunk
    from_device: bool  # the one decode token is read on the device
    prompt_logprobs: bool  # score the prompt tokens of this chunk (echo + logprobs)
    num_generated: int  # output tokens before this chunk's sample: the RNG counter
    cached: list[tuple[int, bytes]] = field(default_factory=list)  # (block, hash) registered
    # in the prefix cache at this launch: not what they say if the step fails
    draft: list[int] = field(default_factory=list)  # tokens proposed after the known last one
    # (speculative decoding: server/spec_decode/proposals.py); num_new counts them


@dataclass(slots=True)
class Step:
    chunks: list[ScheduledChunk]
    handle: PendingStep  # its runner's handle: result() reads it back
    number: int  # launches so far, this one included
    projected: float | None = None  # its seconds on a real card (engine_stats.projected_of)


def holds_grammar_sample(step: Step) -> bool:
    """Whether ``step`` samples for a running sequence under a grammar (structured output)."""
    return any(c.sample and c.seq.matcher is not None and not c.seq.is_finished for c in step.chunks)


def seq_work(c: ScheduledChunk, eos_ids: frozenset[int], vocab_size: int) -> SeqWork:
    seq = c.seq
    p = seq.params
    if c.from_device:
        token_ids = [-1]
    else:
        token_ids = seq.token_ids[c.start : c.start + c.num_new - len(c.draft)] + c.draft
    sampling: SamplingParams = p.sampling
    return SeqWork(
        seq_id=seq.seq_id,
        token_ids=token_ids,
        start_pos=c.start,
        block_table=list(seq.block_table),
        sample=c.sample,
        sampling=sampling,
        num_generated=c.num_generated,
        from_device=c.from_device,
        prompt_logprobs=c.prompt_logprobs,
        pool=p.pooling,
        num_draft=len(c.draft),
        lora=p.lora,
        # the card keeps the penalty state from the tokens it computes; positions below
        # num_prompt are the prompt's (vLLM: repetition counts them, presence and
        # frequency only the output), so the host sends no token history
        num_prompt=seq.num_prompt if sampling.uses_penalties else None,
        # the token sampled here is output token number num_generated (from 0)
        banned_token_ids=(banned_tokens(p, eos_ids, vocab_size) or None)
        if c.sample and c.num_generated < p.min_tokens else None,
        # structured output: what the grammar allows after the tokens known on the host (the
        # scheduler launches such a sequence only when none is pending: never from_device)
        token_mask=seq.matcher.mask() if c.sample and seq.matcher is not None else None,
    )
