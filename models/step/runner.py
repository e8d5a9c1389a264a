"""ModelRunner: a list of SeqWork in, one program launch, a StepOutput back.

The runner glues the pieces of a step together, each in its own module:

    models/step/memory_plan.py      the device memory, planned once (workspace, I/O, KV cache)
    models/step/buckets.py         the buckets and the prepared program of each; warm-up
    models/step/inputs.py      SeqWork list -> checked, packed into the step's input buffer
    models/step/penalty_slots.py    which row of the card's penalty tables a sequence owns
    models/step/program.py     the compiled step and the layout of its buffers
    models/step/prompt_logprobs.py  prompt logprobs, and the row they keep between chunks
    models/step/threads.py          how many cores a step's kernels use (every one)

`launch` packs the work, copies it to the card, and launches the program of the smallest
(token, sequence) bucket that fits, all on one compute stream; it returns a handle at once.
`handle.result()` waits for the step's readback. Launches are FIFO on the stream, so the host
builds step N+1 while the card runs step N; decode tokens marked `from_device` are read on the
card from step N's samples.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from spyre_serve.device import Card, DeviceTensor, LaunchHandle
from spyre_serve.device.isa import current
from spyre_serve.device.kernels.pooling import POOLING_TYPES
from spyre_serve.device.profile import ticks_per_second
from spyre_serve.models.lora.arena import LoraArena
from spyre_serve.models.sizing.fit import capacity
from spyre_serve.models.sizing.projection import StepProjector, step_of_work
from spyre_serve.models.step.buckets import StepPrograms, bucket, buckets
from spyre_serve.models.step.buffer_layout import Placement, length_slot
from spyre_serve.models.step.inputs import PackedStep, StepLimits, check_work, pack_step
from spyre_serve.models.step.interface import SeqWork, SeqWorkError, StepOutput
from spyre_serve.models.step.kv_cache import resolve_dtype as resolve_kv_dtype
from spyre_serve.models.step.memory_plan import StepMemory
from spyre_serve.models.step.penalty_slots import PenaltySlots, StateSlots
from spyre_serve.models.step.program import TIMERS
from spyre_serve.models.step.prompt_logprobs import PromptLogprobs
from spyre_serve.models.step.threads import use_every_core
from spyre_serve.models.step.weights import compute_code, resolve_compute_dtype


class StepHandle:
    """A launched step. `result()` waits for its readback and returns the StepOutput;
    `projected_seconds` is what the step takes on a real card (models/sizing/projection.py)."""

    __slots__ = ("_prompt_logprobs", "_launch", "_step", "_out", "projected_seconds")

    def __init__(self, launch: LaunchHandle, step: _Launched, prompt_logprobs: PromptLogprobs,
                 projected_seconds: float = 0.0):
        self._prompt_logprobs = prompt_logprobs
        self._launch = launch
        self._step = step
        self._out: StepOutput | None = None
        self.projected_seconds = projected_seconds

    def done(self) -> bool:
        return self._launch.done()

    @property
    def bucket(self) -> tuple[int, int]:
        """(tokens, sequences) of the program this step ran."""
        return self._step.packed.dims["T"], self._step.packed.dims["S"]

    def result(self) -> StepOutput:
        if self._out is None:
            self._launch.wait()
            self._out = step_output(self._step, self._prompt_logprobs)
        return self._out


@dataclass(slots=True)
class _Launched:
    """What a launched step's result is made from, once its readback is done."""

    work: list[SeqWork]
    packed: PackedStep
    outputs: Placement            # OUTPUTS of this launch, as in `out`
    out: np.ndarray               # uint8[outputs.nbytes], filled by the readback
    lsm: np.ndarray | None        # [R, V] log-softmax rows (prompt logprobs / debug)
    logits: np.ndarray | None     # [R, V] scaled logits (debug)


class ModelRunner:
    def __init__(self, model, card: Card, max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 block_size: int = 64, num_kv_blocks: int | None = None,
                 kv_cache_fraction: float = 0.9, max_model_len: int | None = None,
                 seed: int | None = None, compute_dtype: str = "auto",
                 kv_cache_dtype: str = "auto", pooling: tuple[str, bool] | None = None,
                 lora: tuple[int, int] | tuple[int, int, int | None] | None = None):
        """`pooling`: (type, normalize) serves embeddings instead of generating (`--runner
        pooling`): each work item is a whole prompt (`SeqWork.pool`), and the step returns its
        rows pooled (device.kernels.pooling: LAST, MEAN or CLS) in `StepOutput.pooled`; a
        context never exceeds one step's tokens. `lora`: (max_loras, max_rank[, max_cpu_loras]), an
        adapter arena of that many slots (`self.lora`, models/lora/arena.py; `SeqWork.lora`)."""
        cfg = model.config
        if (cfg.num_experts or cfg.mamba_layers) and (pooling or lora):
            raise ValueError(f"{cfg.architecture} generates; it is not served with "
                             f"{'--runner pooling' if pooling else '--enable-lora'} yet")
        self.compute_dtype = resolve_compute_dtype(compute_dtype, model.weights)
        self.kv_cache_dtype = resolve_kv_dtype(kv_cache_dtype, self.compute_dtype)
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be positive")
        if max_num_seqs > max_num_batched_tokens:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) exceeds max_num_batched_tokens "
                             f"({max_num_batched_tokens}): every sequence needs a token")
        self.model = model
        self.card = card
        self.config = cfg
        self.weights = model.weights
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.t_buckets = buckets(max_num_batched_tokens)
        self.s_buckets = buckets(max_num_seqs)
        want_len = cfg.max_position_embeddings if max_model_len is None else max_model_len
        self.pooling = pooling
        self.pooling_type, self.normalize = pooling if pooling else (None, False)
        if pooling:                          # a prompt is pooled from one step's rows
            want_len = min(want_len, max_num_batched_tokens)
        cap = capacity(cfg, max_num_seqs, max_num_batched_tokens, want_len, block_size)
        smax = cap.smax
        self.stream = card.new_stream("compute")
        self.lora = LoraArena(card, cfg, *lora[:2], self.stream, *lora[2:]) if lora else None
        try:
            self.memory = StepMemory(card, cfg, self.weights, cap, block_size, num_kv_blocks,
                                     kv_cache_fraction, self.kv_cache_dtype,
                                     self.lora.layer_columns() if self.lora else None, state_slots=2 * smax)
        except BaseException:
            if self.lora:
                self.lora.free()
            raise
        self.kv = self.memory.kv
        self.num_kv_blocks = self.kv.num_blocks
        self.max_model_len = min(want_len, self.kv.num_tokens)
        self.limits = StepLimits(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=block_size,
            num_kv_blocks=self.num_kv_blocks, trash_slot=self.kv.trash_block * block_size,
            max_blocks_per_seq=cap.mbmax, num_penalty_slots=2 * smax,
            vocab_size=cfg.vocab_size,
            seed=random.randrange(1 << 62) if seed is None else int(seed))
        # a hybrid model's Mamba-2 states: a slot per sequence, as many as the penalty tables' rows
        self._state_slots = StateSlots(2 * smax) if cfg.mamba_layers else None
        self.stream.enqueue(use_every_core, compute=False, label="use_every_core")
        self._programs = StepPrograms(card, self.t_buckets, self.s_buckets, self._static_bindings(),
                                      {"H": cfg.hidden_size, "V": cfg.vocab_size})
        self._launches = 0
        self._last_rows: dict[int, int] = {}       # seq_id -> sample row in the previous launch
        self._prev_sampled = (self.memory.outputs[1].address, 0)  # its `sampled`: address, length
        self._prompt_logprobs = PromptLogprobs()
        # WORKSPACE's penalty tables have 2 * SMAX rows: a step's sequences plus those of the
        # step before it, which may end (and be forgotten) only once it is read back
        self._pen_slots = PenaltySlots(self.limits.num_penalty_slots)
        self._timers: DeviceTensor | None = None      # int64[len(TIMERS)] while profiling
        self._timer_bindings: dict = {}
        # each launch's seconds on a real card, the model as placed (one card: tp 1)
        self.projector = StepProjector.of_weights(cfg, self.weights, self.kv_cache_dtype)

    @property
    def numerics(self) -> str:
        """What a step computes with, as responses name it (their system_fingerprint): the
        GEMM weights' formats, the GEMM inputs', the KV cache's and the kernels' ISA level."""
        weights = "+".join(sorted(self.weights.formats))
        return (f"weights={weights},compute={self.compute_dtype},kv={self.kv_cache_dtype},"
                f"isa={current().level}")

    def _static_bindings(self) -> dict:
        """Slots every launch shares: model shapes and addresses, the workspace fields."""
        cfg, w = self.config, self.weights
        return {
            "H": cfg.hidden_size, "HQ": cfg.num_attention_heads, "HKV": cfg.num_key_value_heads,
            "D": cfg.head_dim, "I": cfg.intermediate_size, "V": cfg.vocab_size,
            "L": cfg.num_hidden_layers, "NBT": self.kv.num_blocks + 1, "BS": self.block_size,
            **self._hybrid_bindings(),
            "EMBED_FMT": w.embed.fmt, "LM_HEAD_FMT": w.lm_head.fmt,
            "CFMT": compute_code(self.compute_dtype), "KV_FMT": self.kv.fmt,
            "POOL": 1 + POOLING_TYPES[self.pooling_type] if self.pooling else 0,
            "POOL_NORM": int(self.normalize),
            "H0": 0, "H1": 2 * cfg.num_hidden_layers + 2, "VS": w.lm_head.n,   # the whole step
            "embed": w.embed.tensor, "norm": w.norm, "lm_head": w.lm_head.tensor,
            "inv_freq": w.inv_freq, "consts": w.consts, "layers": self.memory.layer_table,
            "timers": 0, length_slot("timers"): 0,            # timing off (see `profile`)
            **self.memory.workspace_bindings(),
        }

    def _hybrid_bindings(self) -> dict:
        """The Mamba-2 mixers' and the experts' shapes (zeros: a model without them)."""
        cfg = self.config
        m = cfg.mamba if cfg.mamba_layers else None
        shape = (m.d_inner, m.n_heads, m.head_dim, m.d_state, m.n_groups, m.d_conv) if m else (0,) * 6
        return {**dict(zip(("MDI", "MNH", "MP", "MN", "MG", "MK"), shape, strict=True)),
                "NSS": self._state_slots.num_slots if m else 0, "E": cfg.num_experts,
                "TOPK": cfg.num_experts_per_tok, "IE": cfg.expert_intermediate_size}

    @property
    def scratch_bytes(self) -> int:
        """Device bytes of the step workspace, I/O buffers and layer table (KV cache not included)."""
        return self.memory.scratch_bytes

    @property
    def memory_plan(self) -> dict[str, int]:
        """Device bytes the runner planned, by use (see models/step/memory_plan.py); with LoRA,
        'lora_arena' too (its adapter slots: models/lora/arena.py)."""
        return {**self.memory.plan, **({"lora_arena": self.lora.nbytes} if self.lora else {})}

    # ---- programs -------------------------------------------------------------------
    @property
    def programs(self) -> dict:
        """(tokens, sequences) -> the prepared Program of that bucket."""
        return self._programs.programs

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """Every (tokens, sequences) bucket: sequences never exceed tokens."""
        return self._programs.bucket_shapes()

    def warmup(self, progress: bool = True) -> None:
        """Prepare every bucket's program and run each token bucket once on padding (a launch
        with no rows: touches no KV block), so that serving never compiles."""
        self._programs.warmup(lambda t, s: self._launch(t, s, [], False, False).result(),
                              progress)

    # ---- a step ---------------------------------------------------------------------
    def launch(self, work: list[SeqWork], return_logits: bool = False) -> StepHandle:
        """Launch one step for `work`; returns at once. Results come from `handle.result()`."""
        n_tok = check_work(work, self.limits, self._last_rows)
        wrong = {w.seq_id: f"seq {w.seq_id}: pool={w.pool} from position {w.start_pos} on a runner "
                 f"that {'pools whole prompts' if self.pooling else 'generates'}"
                 for w in work if w.pool != bool(self.pooling) or (w.pool and w.start_pos)}
        if wrong:
            raise SeqWorkError(wrong)
        lora_slots = self._lora_slots(work)
        pen_slots = self._pen_slots.assign(work)
        state_slots = self._state_slots.assign(work) if self._state_slots is not None else None
        t = bucket(self.t_buckets, n_tok)
        s = bucket(self.s_buckets, len(work))
        return self._launch(t, s, work, return_rows=return_logits, return_logits=return_logits,
                            pen_slots=pen_slots, projected=self.projector.seconds(
                                step_of_work(work, self.lora and self.lora.targets_of(lora_slots))),
                            lora_slots=lora_slots, state_slots=state_slots)

    def _lora_slots(self, work: list[SeqWork]) -> dict[int, int]:
        """The adapter slot of each item with a LoRA adapter (pinned until `forget`); a
        SeqWorkError for an adapter not registered or with no slot free of other pins."""
        slots, bad = {}, {}
        for w in work:
            if w.lora is None:
                continue
            try:
                if self.lora is None:
                    raise KeyError("this runner serves no LoRA adapters")
                slot = self.lora.pin(w.seq_id, w.lora)
            except KeyError as e:
                bad[w.seq_id] = f"seq {w.seq_id}: LoRA adapter {w.lora!r}: {e.args[0]}"
                continue
            if slot is None:
                bad[w.seq_id] = (f"seq {w.seq_id}: LoRA adapter {w.lora!r}: all "
                                 f"{self.lora.max_loras} slots are held by running sequences")
            else:
                slots[w.seq_id] = slot
        if bad:
            raise SeqWorkError(bad)
        return slots

    def _launch(self, t: int, s: int, work: list[SeqWork], return_rows: bool,
                return_logits: bool, pen_slots: dict[int, int] | None = None,
                projected: float = 0.0, lora_slots: dict[int, int] | None = None,
                state_slots: dict[int, int] | None = None) -> StepHandle:
        step, bindings, readback = self.prepare_launch(t, s, work, return_rows, return_logits, pen_slots,
                                                       lora_slots, state_slots)
        handle = self._programs.get(t, s).launch(self.stream, bindings, readback=readback)
        return StepHandle(handle, step, self._prompt_logprobs, projected)

    def prepare_launch(self, t: int, s: int, work: list[SeqWork], return_rows: bool, return_logits: bool,
                       pen_slots: dict[int, int] | None,
                       lora_slots: dict[int, int] | None = None,
                       state_slots: dict[int, int] | None = None) -> tuple[_Launched, dict, list]:
        """Pack `work` into bucket (t, s), copy it to the card, and count the launch as made:
        (what its result is read from, the program's bindings, the readbacks). The caller
        launches `programs[(t, s)]` with them, whole or in parts (models/parallel/runner.py)."""
        mem, stream = self.memory, self.stream
        if self._state_slots is not None and state_slots is None:
            state_slots = {}                 # a padding launch: every sequence slot -1
        packed = pack_step(mem.inputs_layout, work, t, s, return_rows, self.limits,
                           self._last_rows, pen_slots, lora_slots, state_slots)
        dims = packed.dims
        stream.copy_h2d(mem.inputs_prefix(packed.placement.nbytes), packed.host)
        out_dev = mem.outputs[self._launches & 1]
        outputs = mem.outputs_layout.place({"SR": dims["SR"], "K": dims["K"], "P": s if self.pooling else 0,
                                            "H": self.config.hidden_size})
        out = np.empty(outputs.nbytes, np.uint8)
        readback = [(out, DeviceTensor(out_dev.address, (outputs.nbytes,), np.uint8, self.card))]
        lsm = logits = None
        if dims["R"] > dims["SR"]:          # every row (return_rows) or the prompt-scoring ones
            rows = (dims["R"], self.config.vocab_size)
            lsm = np.empty(rows, np.float32)
            readback.append((lsm, mem.workspace_field("lsm", lsm.size)))
            if return_logits:
                logits = np.empty(rows, np.float32)
                readback.append((logits, mem.workspace_field("logits", logits.size)))
        prev_address, prev_len = self._prev_sampled
        bindings = {**dims, **self._timer_bindings,
                    **packed.placement.bindings(mem.inputs.address),
                    **outputs.bindings(out_dev.address),
                    "prev_sampled": prev_address, length_slot("prev_sampled"): prev_len}
        self._launches += 1
        self._last_rows = packed.sample_rows
        self._prev_sampled = (out_dev.address + outputs.offsets["sampled"], outputs.count("sampled"))
        return (_Launched(work=work, packed=packed, outputs=outputs, out=out, lsm=lsm, logits=logits),
                bindings, readback)

    # ---- profiling ------------------------------------------------------------------
    def profile(self, enabled: bool = True) -> None:
        """Time every kernel of the steps launched from now on (device/profile.py): the step
        adds each kernel's ticks to its timer on the card; `kernel_seconds()` reads them."""
        self.stream.synchronize()
        if enabled and self._timers is None:
            self._timers = self.card.zeros((len(TIMERS),), np.int64)
            self._timer_bindings = {"timers": self._timers,
                                    length_slot("timers"): len(TIMERS)}
        elif not enabled and self._timers is not None:
            self.card.free(self._timers)
            self._timers, self._timer_bindings = None, {}

    def kernel_seconds(self, reset: bool = True) -> dict[str, float]:
        """Device seconds per kernel (names: step_program.TIMERS) over the steps timed since the
        last reset; empty when not profiling."""
        if self._timers is None:
            return {}
        ticks = np.empty(len(TIMERS), np.int64)
        self.stream.copy_d2h(ticks, self._timers)
        if reset:
            self.stream.copy_h2d(self._timers, np.zeros(len(TIMERS), np.int64))
        self.stream.synchronize()
        rate = ticks_per_second()
        return {name: float(t) / rate for name, t in zip(TIMERS, ticks, strict=True)}

    def forget(self, seq_id: int) -> None:
        """Drop what the runner keeps for a sequence between steps (a stashed prompt-logprob
        row of an unfinished prefill, its penalty slot); call it once no launched step that
        holds the sequence is still to be read back, whenever the sequence ends (finished,
        aborted, failed) or is preempted (a recompute starts again from position 0)."""
        self._prompt_logprobs.forget(seq_id)
        self._pen_slots.forget(seq_id)
        if self._state_slots is not None:
            self._state_slots.forget(seq_id)
        if self.lora is not None:
            self.lora.unpin(seq_id)

    def held(self) -> dict[str, int]:
        """Sequences the runner keeps state for between steps, by kind: all 0 once every
        sequence it saw was forgotten."""
        out = {"prompt_logprob_rows": len(self._prompt_logprobs), "penalty_slots": len(self._pen_slots)}
        if self.lora is not None:
            out["lora_pins"] = self.lora.pinned()
        return out

    # ---- lifetime -------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the stream, then give the programs, buffers and KV cache back to the card."""
        self.profile(False)
        self._programs.release()
        self.memory.free()
        if self.lora is not None:
            self.lora.free()


def step_output(step: _Launched, prompt_logprobs: PromptLogprobs) -> StepOutput:
    """The StepOutput of a launched step whose readback is done."""
    p = step.packed
    v = step.outputs.views(step.out)
    ns = p.dims["NS"]
    out = StepOutput(seq_ids=p.sample_seq_ids, token_ids=v["sampled"][:ns].copy(),
                     logprobs=v["logprob"][:ns].copy(), top_ids=v["top_ids"][:ns].copy(),
                     top_logprobs=v["top_logprobs"][:ns].copy())
    if ns > len(p.sample_seq_ids):               # proposals: each keeps its samples up to the
        out.first_rows = p.first_rows             # first that differs from what it proposed
        out.accepted = accepted_counts([w for w in step.work if w.sample], p.first_rows, out.token_ids)
    if "pooled" in v and v["pooled"].shape[0]:       # a pooling runner: every item, in order
        out.seq_ids = [w.seq_id for w in step.work]
        out.pooled = v["pooled"][:len(step.work)].copy()
    if step.lsm is None:
        return out
    s = p.dims["SR"]
    for i, r0 in p.scored_rows.items():
        w = step.work[i]
        if w.prompt_logprobs:
            out.prompt_logprobs[w.seq_id] = prompt_logprobs.of_chunk(w, step.lsm, s + r0)
    if step.logits is not None:
        out.logits = {w.seq_id: step.logits[s + r0:s + r0 + len(w.token_ids)].copy()
                      for w, r0 in zip(step.work, p.row_start, strict=True)}
    return out


def accepted_counts(samplers: list[SeqWork], first_rows: list[int], sampled: np.ndarray) -> list[int]:
    """Tokens each sampling sequence keeps: its first sample, then each next one while the
    sample before it equals the token it proposed there (speculative decoding). Every row
    draws with the RNG counter of the output token it samples, so what is kept is what
    sampling one token a step would have drawn: identical output, greedy or seeded."""
    counts = []
    for w, r0 in zip(samplers, first_rows, strict=True):
        proposed = w.token_ids[len(w.token_ids) - w.num_draft:]
        n = 1
        while n <= w.num_draft and sampled[r0 + n - 1] == proposed[n - 1]:
            n += 1
        counts.append(n)
    return counts
