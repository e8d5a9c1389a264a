"""The host side of a step: a list of SeqWork checked, then packed into one INPUTS buffer.

    limits = StepLimits(...)                       # what the runner was built for
    n_tokens = check_work(work, limits, last_rows) # the token count, or SeqWorkError naming the
                                                   # items at fault (ValueError: the list itself)
    step = pack_step(INPUTS, work, t, s, return_rows, limits, last_rows, pen_slots)
    step.host                                      # uint8[step.placement.nbytes]: copy it to the card
    step.dims                                      # the launch's dim slots (T, S, SR, R, NS, MB,
                                                   # K, NBAN, NMW, NBIAS)

The buffer holds every field of the INPUTS table (models/step/program.py) placed for this
launch's dims; the packing writes it through the placement's named views, so it follows the
table wherever its fields sit. Token rows are the work items' tokens one after the other
(padding rows up to the bucket are not computed, but for a launch with no rows at all,
warmup's, whose rows write the KV cache's trash block); sampling rows are the
sampling sequences in work order (a sequence with proposed tokens, `SeqWork.num_draft`, has
one for each of its last num_draft + 1 token rows: speculative decoding), then from row SR
the token rows whose log-softmax is read back: every
token row with `return_rows` (logits for debugging and benchmarks), else only the rows of
the work items that score their prompt (prompt logprobs), so the readback is proportional to
what is asked (`PackedStep.scored_rows`: where each such item's rows start).

Every value a client chose is checked against the field that holds it (int32 token ids and
top_k, float32 sampling parameters, int64 seeds: SamplingParams.check) before anything is
written, so packing never overflows a host array; an item that does not fit is named in a
SeqWorkError, and the engine fails that sequence alone. The penalties cost O(1) per
sequence: its slot number and prompt length (models/step/penalty_slots.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spyre_serve.models.step.buffer_layout import Layout, Placement, Record
from spyre_serve.models.step.interface import INT32_MAX, INT64_MAX, SeqWork, SeqWorkError

_SEED_MASK = (1 << 63) - 1
# vLLM's _SAMPLING_EPS: a temperature below it samples greedily (1 / t would overflow float32)
GREEDY_BELOW = 1e-5


def greedy_or(temperature: float) -> float:
    """The temperature a row samples at: 0 (greedy) below GREEDY_BELOW."""
    return temperature if temperature >= GREEDY_BELOW else 0.0


@dataclass(frozen=True, slots=True)
class RowContext:
    """What a sampling row's record fields may read beside its SeqWork (the packing's state)."""

    seed: int        # the sequence's own seed (seed_of)
    pen_slot: int    # its penalty slot, -1: no penalties
    mask_row: int    # its grammar mask's row of mask_words, -1: none
    draft_row: int = 0   # which of a sequence's sampling rows this is (0 unless it has proposals)


@dataclass(frozen=True, slots=True)
class StepLimits:
    """What a runner was built for: every launch is checked and packed against these."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    trash_slot: int           # KV slot where padding rows write when computed (first slot of the trash block)
    max_blocks_per_seq: int   # block-table width the input buffer holds (MB's largest)
    num_penalty_slots: int    # sequences with penalties the card keeps state for at once
    vocab_size: int
    seed: int                 # the runner's seed: per-sequence seeds derive from it


@dataclass(slots=True)
class PackedStep:
    host: np.ndarray          # uint8[placement.nbytes]: the INPUTS buffer of this launch
    placement: Placement      # where each INPUTS field sits in it
    dims: dict[str, int]      # dim slots: T, S, SR, R, NS, MB, K, NBAN, NMW, NBIAS
    row_start: list[int]      # token row of each work item's first token
    sample_seq_ids: list[int]  # the sequences that sample, in sampling-row order
    sample_rows: dict[int, int]  # seq_id -> its sampling row (what a from_device decode reads
                                 # next; a sequence with proposals has none: the host decides)
    first_rows: list[int]     # per sample_seq_ids entry: its first sampling row
    attn_pairs: int           # (query row, key) pairs the attention computes
    scored_rows: dict[int, int]  # work index -> the first of its rows after the S sampling rows


# ---- checks ------------------------------------------------------------------------------

def check_work(work: list[SeqWork], limits: StepLimits, last_rows: dict[int, int]) -> int:
    """Tokens in `work`, once every item is known to fit the runner: SeqWorkError naming every
    item that does not (the others are fine), ValueError when the list as a whole does not."""
    if not work:
        raise ValueError("launch: empty work list")
    if len(work) > limits.max_num_seqs:
        raise ValueError(f"launch: {len(work)} sequences exceed max_num_seqs {limits.max_num_seqs}")
    ids = [w.seq_id for w in work]
    if len(set(ids)) != len(ids):
        raise ValueError(f"launch: a sequence appears twice in one step: {sorted(ids)}")
    n_tok, bad = 0, {}
    for w in work:
        try:
            n_tok += check_seq(w, limits, last_rows)
        except (ValueError, TypeError, OverflowError) as exc:
            bad[w.seq_id] = str(exc)
    if bad:
        raise SeqWorkError(bad)
    if n_tok > limits.max_num_batched_tokens:
        raise ValueError(f"launch: {n_tok} tokens exceed max_num_batched_tokens "
                         f"{limits.max_num_batched_tokens}")
    return n_tok


def check_seq(w: SeqWork, limits: StepLimits, last_rows: dict[int, int]) -> int:
    """Tokens of one work item, once its tokens, positions, blocks, device token, sampling,
    penalties and bans are valid; ValueError naming the sequence otherwise."""
    n = len(w.token_ids)
    if n < 1:
        raise ValueError(f"seq {w.seq_id}: no tokens to compute")
    if not w.from_device:
        lo, hi = min(w.token_ids), max(w.token_ids)
        if lo < 0 or hi >= limits.vocab_size:
            raise ValueError(f"seq {w.seq_id}: token id {lo if lo < 0 else hi} is outside the "
                             f"vocabulary (0..{limits.vocab_size - 1})")
    end = w.start_pos + n
    if w.start_pos < 0 or end > limits.max_model_len:
        raise ValueError(f"seq {w.seq_id}: positions {w.start_pos}..{end - 1} exceed "
                         f"max_model_len {limits.max_model_len}")
    need = -(-end // limits.block_size)
    if len(w.block_table) < need:
        raise ValueError(f"seq {w.seq_id}: block table has {len(w.block_table)} blocks, "
                         f"{end} tokens need {need} of {limits.block_size}")
    used = w.block_table[:need]
    if min(used) < 0 or max(used) >= limits.num_kv_blocks:
        raise ValueError(f"seq {w.seq_id}: block ids must be in 0..{limits.num_kv_blocks - 1}, "
                         f"got {min(used)}..{max(used)}")
    if w.from_device:
        if n != 1 or w.token_ids[0] != -1:
            raise ValueError(f"seq {w.seq_id}: a from_device decode has token_ids [-1], "
                             f"got {w.token_ids[:4]}")
        if w.seq_id not in last_rows:
            raise ValueError(f"seq {w.seq_id}: from_device, but it did not sample in the "
                             f"previous launch")
    if w.num_draft:
        _check_draft(w, n)
    if w.sampling.uses_penalties and not (isinstance(w.num_prompt, int)
                                          and 0 <= w.num_prompt <= INT32_MAX):
        raise ValueError(f"seq {w.seq_id}: penalties need num_prompt (the prompt's length, "
                         f"0..{INT32_MAX}), got {w.num_prompt!r}")
    if w.sample:
        w.sampling.check()
        if not 0 <= w.num_generated <= INT64_MAX:
            raise ValueError(f"seq {w.seq_id}: num_generated must be in 0..{INT64_MAX}, "
                             f"got {w.num_generated}")
        if w.banned_token_ids:
            lo, hi = min(w.banned_token_ids), max(w.banned_token_ids)
            if lo < 0 or hi >= limits.vocab_size:
                raise ValueError(f"seq {w.seq_id}: banned token id {lo if lo < 0 else hi} is "
                                 f"outside the vocabulary ({limits.vocab_size})")
        bad = [t for t in (w.sampling.logit_bias or {}) if not 0 <= t < limits.vocab_size]
        if bad:
            raise ValueError(f"seq {w.seq_id}: logit_bias token id {bad[0]} is outside the "
                             f"vocabulary (0..{limits.vocab_size - 1})")
        m = w.token_mask
        if m is not None and not (isinstance(m, np.ndarray) and m.dtype == np.int32
                                  and m.shape == (mask_words(limits.vocab_size),)):
            raise ValueError(f"seq {w.seq_id}: token_mask must be int32[{mask_words(limits.vocab_size)}] "
                             f"(ceil(V/32) words), got {getattr(m, 'dtype', type(m))}"
                             f"{list(getattr(m, 'shape', ()))}")
    elif w.token_mask is not None:
        raise ValueError(f"seq {w.seq_id}: a token_mask on a chunk that does not sample")
    return n


def _check_draft(w: SeqWork, n: int) -> None:
    """ValueError unless `w`'s proposals can be verified in this step: a sampling decode of its
    known last token and the proposals, without the per-token state a proposal would advance
    (penalty counts, a grammar, bans, logit biases are refused: the server does not propose for
    such sequences)."""
    if not (isinstance(w.num_draft, int) and 0 < w.num_draft < n):
        raise ValueError(f"seq {w.seq_id}: num_draft {w.num_draft!r} must be in 1..{n - 1} "
                         f"(the chunk's tokens minus the one known token)")
    if not w.sample or w.from_device or w.prompt_logprobs or w.pool:
        raise ValueError(f"seq {w.seq_id}: proposals need a sampling chunk of known tokens "
                         f"(sample={w.sample}, from_device={w.from_device}, "
                         f"prompt_logprobs={w.prompt_logprobs}, pool={w.pool})")
    unsupported = [name for name, on in (("penalties", w.sampling.uses_penalties),
                                         ("banned tokens", bool(w.banned_token_ids)),
                                         ("a grammar mask", w.token_mask is not None),
                                         ("logit_bias", bool(w.sampling.logit_bias))) if on]
    if unsupported:
        raise ValueError(f"seq {w.seq_id}: proposals cannot be verified with {', '.join(unsupported)}")


def mask_words(vocab_size: int) -> int:
    """Words of a grammar mask: one bit per token of the vocabulary, 32 to an int32."""
    return (vocab_size + 31) // 32


def _check_vocab(v: dict[str, np.ndarray], vocab_size: int) -> None:
    """Token ids as packed must index the vocabulary (the embedding does not check); what
    check_seq let through is in range, so this only guards the packing itself."""
    tokens = v["tokens"]
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = int(tokens.min()) if tokens.min() < 0 else int(tokens.max())
        raise ValueError(f"launch: token id {bad} is outside the vocabulary ({vocab_size})")


# ---- per-sequence lists ------------------------------------------------------------------

def _ban_lists(samplers: list[SeqWork]) -> list[np.ndarray]:
    """Unique banned ids per sampling sequence (at most V each, so they fit NBAN's largest)."""
    return [np.unique(np.asarray(w.banned_token_ids, np.int32)) if w.banned_token_ids
            else np.zeros(0, np.int32) for w in samplers]


def seed_of(w: SeqWork, runner_seed: int) -> int:
    """The sequence's own seed, or one derived from the runner's seed and its seq_id."""
    if w.sampling.seed is not None:
        return int(w.sampling.seed) & _SEED_MASK
    return (runner_seed * 1_000_003 + w.seq_id * 7_919) & _SEED_MASK


# ---- packing -----------------------------------------------------------------------------

def pack_step(layout: Layout, work: list[SeqWork], t: int, s: int, return_rows: bool,
              limits: StepLimits, last_rows: dict[int, int],
              pen_slots: dict[int, int] | None = None,
              lora_slots: dict[int, int] | None = None,
              state_slots: dict[int, int] | None = None) -> PackedStep:
    """The INPUTS buffer of a launch of bucket (t, s) for `work` (already checked; empty for
    a padding launch). `last_rows` are the previous launch's sample_rows; `pen_slots` the
    penalty slot of each sequence with penalties (models/step/penalty_slots.py); `lora_slots` the
    adapter slot of each sequence with a LoRA adapter (models/lora/arena.py); `state_slots` (a
    hybrid model's) every sequence's slot of the Mamba-2 states, reset where its chunk starts at
    position 0."""
    pen_slots = pen_slots or {}
    missing = [w.seq_id for w in work if w.sampling.uses_penalties and w.seq_id not in pen_slots]
    if missing:
        raise SeqWorkError({i: f"seq {i}: penalties but no penalty slot" for i in missing})
    samplers = [w for w in work if w.sample]
    bans = _ban_lists(samplers)
    n_rows = sum(1 + w.num_draft for w in samplers)
    if return_rows and n_rows > len(samplers):   # R = SR + T would pass the logit rows' room
        raise ValueError("launch: return_logits with proposed tokens (SeqWork.num_draft)")
    mb = min(max([len(w.block_table) for w in work] + [1]), limits.max_blocks_per_seq) if work else 1
    scored = [i for i, w in enumerate(work) if return_rows or w.prompt_logprobs]
    n_tok = sum(len(w.token_ids) for w in work)     # the step's rows: the program computes no others
    n_scored = n_tok if return_rows else sum(len(work[i].token_ids) for i in scored)
    sr = s + n_rows - len(samplers)
    dims = {"T": t, "S": s, "SR": sr, "R": sr + n_scored, "NS": n_rows, "MB": mb,
            "K": max([w.sampling.logprobs for w in work] + [0]),
            "NBAN": sum(len(b) for b in bans),
            "NMW": sum(w.token_mask is not None for w in samplers) * mask_words(limits.vocab_size),
            "NBIAS": sum(len(w.sampling.logit_bias or ()) for w in samplers),
            "SST": s if state_slots is not None else 0}
    placement = layout.place(dims)
    host = np.zeros(placement.nbytes, np.uint8)
    v = placement.views(host)
    records = _records(placement)
    _write_defaults(v, records, limits.trash_slot)
    row_start = _write_rows(v, work, limits.block_size, last_rows, pen_slots)
    for w, r0 in zip(work, row_start, strict=True):
        v["lora_slot"][r0:r0 + len(w.token_ids)] = (lora_slots or {}).get(w.seq_id, -1)
    if state_slots is not None:
        for i, w in enumerate(work):
            v["state_slot"][i] = state_slots[w.seq_id]
            v["state_reset"][i] = w.start_pos == 0
    sample_rows, first_rows = _write_sampling(v, records, work, row_start, bans, limits.seed, pen_slots)
    scored_rows, at = {}, 0
    if return_rows:
        v["logit_rows"][sr:sr + n_tok] = np.arange(n_tok, dtype=np.int32)
        scored_rows = {i: row_start[i] for i in scored}
    for i in scored if not return_rows else ():
        n = len(work[i].token_ids)
        v["logit_rows"][sr + at:sr + at + n] = np.arange(row_start[i], row_start[i] + n, dtype=np.int32)
        scored_rows[i], at = at, at + n
    _check_vocab(v, limits.vocab_size)
    attn_pairs = sum((w.start_pos + len(w.token_ids)) * len(w.token_ids) for w in work)
    return PackedStep(host=host, placement=placement, dims=dims, row_start=row_start,
                      sample_seq_ids=[w.seq_id for w in samplers], sample_rows=sample_rows,
                      first_rows=first_rows, attn_pairs=attn_pairs, scored_rows=scored_rows)


def _records(placement: Placement) -> list[tuple[str, Record]]:
    """The placement's fields of records (one per sampling row)."""
    return [(f.name, f.dtype) for f in placement.fields if isinstance(f.dtype, Record)]


def _write_defaults(v: dict[str, np.ndarray], records: list[tuple[str, Record]],
                    trash_slot: int) -> None:
    """What padding rows and sequences read (the buffer starts zeroed): padding rows (computed
    only in a launch with no rows, warmup's) write the trash block and read no device token;
    sampling rows without a sequence sample nothing, and their neutral parameters keep the
    kernels' arithmetic finite."""
    v["slot_mapping"][:] = trash_slot
    v["src_rows"][:] = -1
    v["count_slot"][:] = -1
    v["lora_slot"][:] = -1
    v["state_slot"][:] = -1
    for name, record in records:
        v[name][:] = record.defaults


def _write_rows(v: dict[str, np.ndarray], work: list[SeqWork], bs: int,
                last_rows: dict[int, int], pen_slots: dict[int, int]) -> list[int]:
    """Token rows, per-sequence attention inputs and penalty slots (the device counts the
    rows of a sequence with one); returns each item's first row."""
    tokens, positions, slots, src_rows = v["tokens"], v["positions"], v["slot_mapping"], v["src_rows"]
    query_start, context_lens, block_tables = v["query_start"], v["context_lens"], v["block_tables"]
    mb = block_tables.shape[1]
    row = 0
    row_start = []
    for i, w in enumerate(work):
        n = len(w.token_ids)
        end = w.start_pos + n
        row_start.append(row)
        if w.from_device:
            src_rows[row] = last_rows[w.seq_id]
        else:
            tokens[row:row + n] = w.token_ids
        pos = np.arange(w.start_pos, end, dtype=np.int32)
        positions[row:row + n] = pos
        bt = np.asarray(w.block_table, dtype=np.int32)
        slots[row:row + n] = bt[pos // bs] * bs + pos % bs
        query_start[i] = row
        context_lens[i] = end
        block_tables[i, :len(bt)] = bt[:mb]
        if w.seq_id in pen_slots:
            v["count_slot"][i] = pen_slots[w.seq_id]
            v["prompt_lens"][i] = w.num_prompt
        row += n
    query_start[len(work):] = row
    return row_start


def _write_sampling(v: dict[str, np.ndarray], records: list[tuple[str, Record]],
                    work: list[SeqWork], row_start: list[int], bans: list[np.ndarray],
                    runner_seed: int, pen_slots: dict[int, int]) -> tuple[dict[int, int], list[int]]:
    """Sampling rows 0..NS-1 (their records, ban lists, masks, biases): one per sampling
    sequence, or one per row of its proposals and the token before them. Returns seq_id -> row
    (the sequences a from_device decode may read next) and each sampling sequence's first row."""
    ban_ids = v["ban_ids"]
    samplers = [(w, r0) for w, r0 in zip(work, row_start, strict=True) if w.sample]
    ban_pos = bias_pos = masks = j = 0
    rows: dict[int, int] = {}
    first_rows: list[int] = []
    for i, (w, r0) in enumerate(samplers):
        mask_row = -1
        if w.token_mask is not None:
            mw = len(w.token_mask)
            mask_row = masks
            v["mask_words"][masks * mw:(masks + 1) * mw] = w.token_mask
            masks += 1
        seed, bias = seed_of(w, runner_seed), w.sampling.logit_bias or {}
        first_rows.append(j)
        last = r0 + len(w.token_ids) - 1
        for d in range(w.num_draft + 1):   # proposals carry no bans, masks or biases (_check_draft)
            v["logit_rows"][j] = last - w.num_draft + d
            v["ban_start"][j] = ban_pos
            v["bias_start"][j] = bias_pos
            ctx = RowContext(seed=seed, pen_slot=pen_slots.get(w.seq_id, -1), mask_row=mask_row,
                             draft_row=d)
            for name, record in records:
                v[name][j] = record.row(w, ctx)
            j += 1
        ban_ids[ban_pos:ban_pos + len(bans[i])] = bans[i]
        ban_pos += len(bans[i])
        v["bias_ids"][bias_pos:bias_pos + len(bias)] = list(bias)
        v["bias"][bias_pos:bias_pos + len(bias)] = list(bias.values())
        bias_pos += len(bias)
        if not w.num_draft:
            rows[w.seq_id] = first_rows[-1]
    v["ban_start"][j:] = ban_pos
    v["bias_start"][j:] = bias_pos
    return rows, first_rows
