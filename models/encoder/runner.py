"""EncoderRunner: a list of SeqWork (whole prompts) in, one encoder program launch, a StepOutput
of pooled embeddings back (the server's /v1/embeddings on a RoBERTa-family checkpoint).

It offers what the engine reads of a runner (server/engine/seams.py's StepRunner, and what the CLI
prints), as models/step/runner.py's ModelRunner does, with the encoder's own step:

    models/encoder/program.py   the compiled step and the layout of its buffers
    models/encoder/weights.py   the weights on the card and their layer table
    models/step/buckets.py          buckets: the smallest (tokens, sequences) one a step fits

The encoder holds no KV cache: every prompt is computed whole in one step (its SeqWork starts
at position 0 and is marked `pool`, as the server sends an embedding, or `sample`: the chunk
that completes a prompt), so a prompt is at most max_num_batched_tokens long. The scheduler still counts KV blocks:
`num_kv_blocks` is enough virtual blocks for max_num_seqs sequences of max_model_len, which cost nothing and are never
read.

`launch` packs the tokens, copies them to the card and launches the bucket's program, all on one
compute stream (FIFO: the host packs step N+1 while the card runs step N); it returns a handle
at once, and `handle.result()` waits for the readback of the pooled rows. The handle carries
the step's time on a real card (`projected_seconds`, priced by `runner.projector`: an
EncoderProjector, models/encoder/projection.py), as a generating runner's does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spyre_serve.device import Card, DeviceTensor, LaunchHandle, Program
from spyre_serve.device import Slot as ProgramSlot
from spyre_serve.device.isa import current
from spyre_serve.device.kernels.pooling import POOLING_TYPES
from spyre_serve.models.encoder.program import INPUTS, OUTPUTS, SLOTS, WORKSPACE, encoder_entry
from spyre_serve.models.encoder.projection import EncoderProjector
from spyre_serve.models.encoder.weights import build_encoder_layer_table
from spyre_serve.models.sizing.projection import step_of_work
from spyre_serve.models.step.buckets import StepPrograms, bucket, buckets
from spyre_serve.models.step.buffer_layout import Placement
from spyre_serve.models.step.interface import SeqWork, SeqWorkError, StepOutput
from spyre_serve.models.step.threads import use_every_core


class EncoderPrograms(StepPrograms):
    """StepPrograms (buckets, warm-up, release) whose programs run `encoder_entry`."""

    def get(self, t: int, s: int) -> Program:
        """The prepared program of bucket (t, s)."""
        prog = self.programs.get((t, s))
        if prog is None:
            prog = Program(self.card, name=f"encoder_t{t}_s{s}", entry=encoder_entry,
                           slots=[ProgramSlot(n, k) for n, k in SLOTS],
                           shapes={"T": t, "S": s, **self._shapes})
            prog.prepare()
            prog.bind(self._static)
            self.programs[(t, s)] = prog
        return prog


@dataclass(slots=True)
class EncoderHandle:
    """A launched encoder step. `result()` waits for its readback and returns the StepOutput."""

    launch: LaunchHandle
    seq_ids: list[int]
    pooled: np.ndarray            # float32[S bucket, H], filled by the readback
    bucket: tuple[int, int]       # (tokens, sequences) of the program this step ran
    projected_seconds: float = 0.0   # the step on a real card (models/encoder/projection.py)

    def done(self) -> bool:
        return self.launch.done()

    def result(self) -> StepOutput:
        """One row of `pooled` per work item, in work order; nothing sampled."""
        self.launch.wait()
        n = len(self.seq_ids)
        return StepOutput(seq_ids=list(self.seq_ids), token_ids=np.zeros(n, np.int32),
                          logprobs=np.zeros(n, np.float32), top_ids=np.zeros((n, 0), np.int32),
                          top_logprobs=np.zeros((n, 0), np.float32),
                          pooled=self.pooled[:n].copy())


class EncoderRunner:
    compute_dtype = "float32"      # GEMM inputs, activations and sums
    kv_cache_dtype = "none"        # no KV cache

    def __init__(self, model, card: Card, max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 max_model_len: int | None = None, pooling_type: str = "CLS",
                 normalize: bool = True, block_size: int = 64):
        """`model`: a models.checkpoints.loader.LoadedModel of an encoder (models/encoder/weights.py's
        load_encoder); `pooling_type`: "CLS", "MEAN" or "LAST" (device/kernels/pooling.py);
        `normalize`: pooled vectors of unit length."""
        cfg = model.config
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or block_size < 1:
            raise ValueError(f"max_num_seqs ({max_num_seqs}), max_num_batched_tokens "
                             f"({max_num_batched_tokens}) and block_size ({block_size}) must be "
                             f"positive")
        if max_num_seqs > max_num_batched_tokens:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) exceeds max_num_batched_tokens "
                             f"({max_num_batched_tokens}): every sequence needs a token")
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {sorted(POOLING_TYPES)}, got "
                             f"{pooling_type!r}")
        want = cfg.max_model_len if max_model_len is None else max_model_len
        if not 1 <= want <= cfg.max_model_len:
            raise ValueError(f"max_model_len {want} must be in 1..{cfg.max_model_len} (the "
                             f"model's {cfg.max_position_embeddings} positions start after "
                             f"pad_token_id {cfg.pad_token_id})")
        self.model, self.card, self.config, self.weights = model, card, cfg, model.weights
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = min(want, max_num_batched_tokens)   # one step holds a whole prompt
        self.block_size = block_size
        self.num_kv_blocks = max_num_seqs * -(-self.max_model_len // block_size)
        self.pooling_type, self.normalize = pooling_type, bool(normalize)
        self.t_buckets = buckets(max_num_batched_tokens)
        self.s_buckets = buckets(max_num_seqs)
        tmax, smax, h = self.t_buckets[-1], self.s_buckets[-1], cfg.hidden_size
        self._allocated: list[DeviceTensor] = []
        try:
            self.workspace_placement = WORKSPACE.place({"TMAX": tmax, "H": h,
                                                        "I": cfg.intermediate_size})
            self.workspace = self._alloc(self.workspace_placement.nbytes, zero=True)
            self.inputs = self._alloc(INPUTS.place({"T": tmax, "S": smax}).nbytes)
            self.outputs = self._alloc(OUTPUTS.place({"S": smax, "H": h}).nbytes, zero=True)
            self.layer_table = build_encoder_layer_table(card, self.weights)
            self._allocated.append(self.layer_table)
        except BaseException:
            self._free()
            raise
        self.stream = card.new_stream("compute")
        self.stream.enqueue(use_every_core, compute=False, label="use_every_core")
        self._programs = EncoderPrograms(card, self.t_buckets, self.s_buckets,
                                         self._static_bindings(), {"H": h, "V": cfg.vocab_size})
        self.programs = self._programs.programs        # filled as buckets are prepared
        self.projector = EncoderProjector.of_weights(cfg, self.weights, pooling_type)
        self.bucket_shapes = self._programs.bucket_shapes

    def _alloc(self, nbytes: int, zero: bool = False) -> DeviceTensor:
        t = self.card.zeros((nbytes,), np.uint8) if zero else self.card.empty((nbytes,), np.uint8)
        self._allocated.append(t)
        return t

    def _static_bindings(self) -> dict:
        """Slots every launch shares: model shapes and addresses, pooling, the workspace."""
        cfg, w = self.config, self.weights
        return {
            "POOL": POOLING_TYPES[self.pooling_type], "POOL_NORM": int(self.normalize),
            "H": cfg.hidden_size, "HQ": cfg.num_attention_heads, "D": cfg.head_dim,
            "I": cfg.intermediate_size, "V": cfg.vocab_size, "L": cfg.num_hidden_layers,
            "NPOS": cfg.max_position_embeddings,
            "word_embed": w.word_embed, "pos_embed": w.pos_embed, "type_embed": w.type_embed,
            "embed_norm_w": w.embed_norm_w, "embed_norm_b": w.embed_norm_b, "consts": w.consts,
            "layers": self.layer_table,
            **self.workspace_placement.bindings(self.workspace.address),
        }

    @property
    def pooling(self) -> tuple[str, bool]:
        """(pooling type, normalize), as ModelRunner(pooling=...) names them."""
        return self.pooling_type, self.normalize

    @property
    def numerics(self) -> str:
        """What a step computes with, as responses name it (their system_fingerprint)."""
        weights = "+".join(sorted(self.weights.formats))
        return f"weights={weights},compute=float32,kv=none,isa={current().level}"

    @property
    def memory_plan(self) -> dict[str, int]:
        """Device bytes by use: 'weights', 'workspace', 'io' (input and output buffers),
        'layer_table', 'kv_cache' (0: none), and 'scratch' (the three before it)."""
        plan = {"weights": self.weights.nbytes, "workspace": self.workspace.nbytes,
                "io": self.inputs.nbytes + self.outputs.nbytes,
                "layer_table": self.layer_table.nbytes, "kv_cache": 0}
        plan["scratch"] = plan["workspace"] + plan["io"] + plan["layer_table"]
        return plan

    # ---- programs: `programs` ((tokens, sequences) -> the prepared Program of that bucket)
    # and `bucket_shapes()` are the EncoderPrograms' own (set in __init__) ------------------
    def warmup(self, progress: bool = True) -> None:
        """Prepare every bucket's program and run each token bucket once on padding (a launch
        with no prompt), so that serving never compiles."""
        self._programs.warmup(lambda t, s: self._launch(t, s, []).result(), progress)

    # ---- a step ---------------------------------------------------------------------
    def check(self, work: list[SeqWork]) -> int:
        """Tokens in `work` once every item is a whole prompt the runner holds: SeqWorkError
        naming each item that is not (ValueError when the list as a whole does not fit)."""
        ids = {w.seq_id for w in work}
        if not 1 <= len(work) <= self.max_num_seqs or len(ids) != len(work):
            raise ValueError(f"launch: {len(work)} work items for sequences {sorted(ids)}; a step "
                             f"takes 1..{self.max_num_seqs} (max_num_seqs), each sequence once")
        bad, v = {}, self.config.vocab_size
        for w in work:
            n = len(w.token_ids)
            whole = w.start_pos == 0 and (w.sample or w.pool)
            if not whole or w.from_device:
                bad[w.seq_id] = (f"seq {w.seq_id}: an encoder computes a whole prompt in one step "
                                 f"(start_pos 0, pool or sample set); got start_pos {w.start_pos}, "
                                 f"pool={w.pool}, sample={w.sample}, from_device={w.from_device}")
            elif not 1 <= n <= self.max_model_len:
                bad[w.seq_id] = (f"seq {w.seq_id}: {n} tokens; a prompt has 1..{self.max_model_len} "
                                 f"(max_model_len)")
            elif min(w.token_ids) < 0 or max(w.token_ids) >= v:
                tok = min(w.token_ids) if min(w.token_ids) < 0 else max(w.token_ids)
                bad[w.seq_id] = f"seq {w.seq_id}: token id {tok} is outside the vocabulary (0..{v - 1})"
        if bad:
            raise SeqWorkError(bad)
        n_tok = sum(len(w.token_ids) for w in work)
        if n_tok > self.max_num_batched_tokens:
            raise ValueError(f"launch: {n_tok} tokens exceed max_num_batched_tokens "
                             f"{self.max_num_batched_tokens}")
        return n_tok

    def launch(self, work: list[SeqWork]) -> EncoderHandle:
        """Launch one step for `work`; returns at once. Results come from `handle.result()`."""
        n_tok = self.check(work)
        handle = self._launch(bucket(self.t_buckets, n_tok), bucket(self.s_buckets, len(work)), work)
        handle.projected_seconds = self.projector.seconds(step_of_work(work))
        return handle

    def pack(self, work: list[SeqWork], t: int, s: int) -> tuple[np.ndarray, Placement]:
        """The INPUTS buffer of a launch of bucket (t, s): each prompt's tokens one after the
        other, at positions pad_token_id + 1 + index (RoBERTa's); rows past them padding
        (pad_token_id at its first position) in no sequence."""
        placement = INPUTS.place({"T": t, "S": s})
        host = np.zeros(placement.nbytes, np.uint8)
        v = placement.views(host)
        first = self.config.pad_token_id + 1
        v["tokens"][:] = self.config.pad_token_id
        v["positions"][:] = first
        row = 0
        for i, w in enumerate(work):
            n = len(w.token_ids)
            v["tokens"][row:row + n] = w.token_ids
            v["positions"][row:row + n] = np.arange(first, first + n, dtype=np.int32)
            v["query_start"][i] = row
            row += n
        v["query_start"][len(work):] = row
        return host, placement

    def _launch(self, t: int, s: int, work: list[SeqWork]) -> EncoderHandle:
        host, placement = self.pack(work, t, s)
        self.stream.copy_h2d(DeviceTensor(self.inputs.address, (placement.nbytes,), np.uint8,
                                          self.card), host)
        outputs = OUTPUTS.place({"S": s, "H": self.config.hidden_size})
        pooled = np.empty((s, self.config.hidden_size), np.float32)
        readback = [(pooled, DeviceTensor(self.outputs.address + outputs.offsets["pooled"],
                                          (pooled.size,), np.float32, self.card))]
        bindings = {"T": t, "S": s, **placement.bindings(self.inputs.address),
                    **outputs.bindings(self.outputs.address)}
        handle = self._programs.get(t, s).launch(self.stream, bindings, readback=readback)
        return EncoderHandle(handle, [w.seq_id for w in work], pooled, (t, s))

    def forget(self, seq_id: int) -> None:
        """Nothing is kept for a sequence between steps (each prompt is computed whole)."""

    def held(self) -> dict[str, int]:
        """Sequences the runner keeps state for between steps: none."""
        return {}

    # ---- lifetime -------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the stream, then give the programs and buffers back to the card (the
        weights belong to the model)."""
        self.stream.synchronize()
        self._programs.release()
        self._free()

    def _free(self) -> None:
        for t in self._allocated:
            self.card.free(t)
        self._allocated = []
