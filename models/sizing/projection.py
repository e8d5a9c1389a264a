"""The real card's clock for one step of our step program, and for one request.

`project_step(config, step)` prices the kernels models/step/program.py runs, in its order,
on a real Spyre card (device/cost_model.py: each kernel max(bytes / bandwidth, FLOPs /
sustained rate of its format), rows padded to whole 128-byte sticks), plus the collectives
between cards at tensor-parallel degree `tp`, the host link's bytes and the launch:

    embedding gather                                (a vocabulary shard: + all-reduce [T, H])
    per layer: rmsnorm, QKV GEMM, rope, write_kv, attention over each sequence's context,
               O GEMM (+ all-reduce [T, H]), residual, rmsnorm, gate/up GEMM, swiglu,
               down GEMM (+ all-reduce [T, H]), residual;
               each LoRA adapter's rows through the modules it targets (shrink, expand)
               (a hybrid's Mamba-2 layer instead of attention: in_proj GEMM, conv, scan with each
               sequence's states read and written, gated norm, out_proj GEMM; experts beside or
               instead of the MLP: the router GEMM, each chosen expert's matrices read once,
               each row's k experts computed)
    final rmsnorm and LM head on the logit rows (+ all-gather of the logits), sampling

Weights are split as the vLLM Spyre plugin shards them: QKV, gate and up by columns (heads),
O and down by rows, the LM head (and the tied embedding) by vocabulary; so a card holds
Hq/tp query heads, Hkv/tp KV heads (one, replicated, past Hkv cards), I/tp of the MLP and
ceil(V/tp) of the vocabulary, and the row-split GEMMs' partial sums are all-reduced.
Activations are fp16 on the card (ACT_BYTES). docs/projection.md has the formula and sources.

    step = StepShape(queries=(512,), contexts=(1024,), logit_rows=1)   # a prefill chunk
    project_step(config, step, tp=2).seconds / .by_kernel
    project_request(config, prompt_tokens=1024, output_tokens=128, batch=32) -> (ttft, tpot)
    prefill_steps(prompt_tokens, chunk), decode_step(batch, context)   # the steps it prices
    StepProjector(config, tp, spec, formats, kv_bytes).seconds(step)   # precomputed: the runner's
    step_of_work(work, lora)                                           # a launch's SeqWork list

LoRA adapters (`StepShape.adapters`, one `AdapterRows` each) are priced as our step program
runs them (punica's shrink and expand): every adapter in the step has its A and B read once per
targeted module and layer, at its own rank r (its slot's first r rows: device/kernels/lora.py),
and its rows go through them: 2 rows r (K + N) operations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from spyre_serve.device.cost_model import (
    SPYRE,
    CardSpec,
    allgather_seconds,
    allreduce_seconds,
    format_bytes,
    format_name,
    kernel_seconds,
    padded,
    row_bytes,
)
from spyre_serve.models.config import GraniteConfig

ACT_BYTES = 2              # activations on the card: fp16 (DLFloat16) [DESIGN]
KV_BLOCK = 64              # tokens of a KV cache block, read whole (the plugin's block size)
SAMPLING_PASSES = 2        # a softmax reads each logit row twice: its max and sum, then the draw
# what the host copies per step (models/step/program.py's INPUTS and OUTPUTS tables): per token
# row its token, position, slot, source row and LoRA slot (int32 each); per sequence its record of sampling
# parameters and eight int32 fields (56 + 32); per KV block of its table an int32; per logit row
# back its sampled id and logprob
INPUT_BYTES_PER_ROW, INPUT_BYTES_PER_SEQ, INPUT_BYTES_PER_BLOCK, OUTPUT_BYTES_PER_ROW = 20, 88, 4, 8
MATRICES = ("embed", "qkv", "o", "gate_up", "down", "lm_head", "mamba_in", "mamba_out", "router", "experts")
KERNELS = ("embedding", "rmsnorm", "qkv", "rope", "write_kv", "attention", "o_proj", "residual",
           "gate_up", "swiglu", "down", "lora", "mamba_in", "mamba_conv", "ssm_scan", "mamba_norm",
           "mamba_out", "router", "experts", "all_reduce", "lm_head", "logits_gather", "sampling",
           "pcie", "launch")
STATE_BYTES = 4            # a Mamba-2 layer's conv and SSM states are float32
# the modules a LoRA adapter may target: models/lora/layout.py's MODULES (kept here by name, so
# pricing a step imports no kernel; a test checks they agree)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class AdapterRows:
    """One LoRA adapter's part of a step: its token `rows`, the `modules` it targets (of
    LORA_MODULES) and its `rank`."""

    rows: int
    modules: tuple[str, ...]
    rank: int


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes: per sequence the token rows it computes (`queries`) and its context
    after the step (`contexts`, >= its queries), and the rows through the LM head (`logit_rows`:
    the sampling rows, plus any prompt rows scored)."""

    queries: tuple[int, ...]
    contexts: tuple[int, ...]
    logit_rows: int
    adapters: tuple[AdapterRows, ...] = ()   # the LoRA adapters its rows run with (none: the base)

    def __post_init__(self) -> None:
        if len(self.queries) != len(self.contexts):
            raise ValueError(f"StepShape: {len(self.queries)} queries but {len(self.contexts)} contexts")
        bad = [(q, c) for q, c in zip(self.queries, self.contexts, strict=True) if not 1 <= q <= c]
        if bad or not 0 <= self.logit_rows <= self.tokens + self.seqs:
            raise ValueError(f"StepShape: each sequence needs 1 <= queries <= context (got {bad[:3]}), "
                             f"and 0 <= logit_rows {self.logit_rows} <= tokens + sequences "
                             f"{self.tokens + self.seqs}")
        rows = sum(a.rows for a in self.adapters)
        unknown = {m for a in self.adapters for m in a.modules} - set(LORA_MODULES)
        if unknown or rows > self.tokens or any(a.rows < 1 or a.rank < 1 for a in self.adapters):
            raise ValueError(f"StepShape: adapters need rows >= 1 and a rank >= 1, {rows} rows in "
                             f"all at most the {self.tokens} tokens, and modules of {LORA_MODULES} "
                             f"(unknown: {sorted(unknown)})")

    @property
    def tokens(self) -> int:
        """T: token rows of the step."""
        return sum(self.queries)

    @property
    def seqs(self) -> int:
        """S: sequences in the step."""
        return len(self.queries)


def decode_step(batch: int, context: int) -> StepShape:
    """`batch` decodes, each sequence holding `context` tokens after the step, each sampling."""
    return StepShape((1,) * batch, (context,) * batch, batch)


def prefill_steps(prompt_tokens: int, chunk: int = 512) -> list[StepShape]:
    """A prompt's prefill as the vLLM Spyre plugin runs it: chunks of `chunk` tokens (a multiple
    of the 64-token block), one step each, the last sampling the first token; ValueError
    otherwise."""
    if prompt_tokens < 1 or chunk < KV_BLOCK or chunk % KV_BLOCK:
        raise ValueError(f"prefill of {prompt_tokens} tokens in chunks of {chunk}: the prompt needs a "
                         f"token, the chunk a positive multiple of the {KV_BLOCK}-token block "
                         "(the plugin's rule)")
    ends = [*range(chunk, prompt_tokens, chunk), prompt_tokens]
    return [StepShape((end - start,), (end,), int(end == prompt_tokens))
            for start, end in zip([0, *ends[:-1]], ends, strict=True)]


def step_of_work(work, lora: Mapping[int, tuple[int, tuple[str, ...], int]] | None = None) -> StepShape:
    """The shape of a launch's work (a list of models.step.interface.SeqWork): its tokens, contexts,
    and the rows of the sampling items and of the prompt-scored ones; with `lora` (seq_id ->
    (the adapter's slot, the modules it targets, its rank), for the items with an adapter) the
    rows of each slot."""
    queries, contexts, rows = [], [], 0
    by_slot: dict[int, list] = {}
    for w in work:
        n = len(w.token_ids)
        queries.append(n)
        contexts.append(w.start_pos + n)
        rows += (n if w.prompt_logprobs else 0) + (1 if w.sample else 0)
        if lora and w.seq_id in lora:
            slot, modules, rank = lora[w.seq_id]
            by_slot.setdefault(slot, [0, modules, rank])[0] += n
    adapters = tuple(AdapterRows(n, tuple(m), r) for n, m, r in by_slot.values())
    return StepShape(tuple(queries), tuple(contexts), rows, adapters)


@dataclass(slots=True)
class StepCost:
    seconds: float                   # the step on the card: the sum of by_kernel
    by_kernel: dict[str, float]      # KERNELS -> seconds (each summed over the layers)


@dataclass(frozen=True, slots=True)
class LinearKernel:
    """A kernel whose bytes and FLOPs grow by a fixed amount per row: `weight` bytes read
    once, then per row `read` and `written` bytes and `flops`, `times` per step."""

    name: str
    times: int
    weight: float
    read: float
    written: float
    flops: float
    fmt: str = "fp16"


def linear_seconds(k: LinearKernel, rows: int, spec: CardSpec = SPYRE) -> float:
    """One run of kernel `k` over `rows` rows on the card (0 without rows)."""
    if rows == 0:
        return 0.0
    written = rows * k.written
    return kernel_seconds(k.weight + rows * k.read + written, rows * k.flops, k.fmt, spec, written)


def step_cost(out: dict[str, float], host_bytes: float, spec: CardSpec = SPYRE) -> StepCost:
    """A step's kernels (`out`) with its copies over the host link ("pcie") and its launch."""
    out["pcie"] = host_bytes / spec.link_bw
    out["launch"] = spec.launch_seconds
    return StepCost(sum(out.values()), out)


def weight_formats(formats: str | Mapping[str, str]) -> dict[str, str]:
    """Each matrix's format (MATRICES): one format for every matrix, or a mapping naming some
    (the others fp16); ValueError for an unknown matrix or format."""
    if isinstance(formats, str):
        return dict.fromkeys(MATRICES, format_name(formats))
    unknown = set(formats) - set(MATRICES)
    if unknown:
        raise ValueError(f"unknown matrices {sorted(unknown)}: the step's are {list(MATRICES)}")
    return {m: format_name(formats.get(m, "fp16")) for m in MATRICES}


def shard(config: GraniteConfig, tp: int) -> tuple[int, int, int, int]:
    """(query heads, KV heads, MLP width, vocabulary) one card holds at degree `tp`; ValueError
    when the heads or the MLP do not split evenly."""
    c = config
    hq, hkv, inter = c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    if tp < 1 or hq % tp or inter % tp or (hkv % tp and tp % hkv):
        raise ValueError(f"tensor parallel {tp} does not split {hq} query heads, {hkv} KV heads "
                         f"and an MLP of {inter} evenly")
    return hq // tp, max(1, hkv // tp), inter // tp, -(-c.vocab_size // tp)


class StepProjector:
    """The kernels of a model's step at degree `tp`, priced once per row: `project(step)` is a
    few dozen float operations plus one pass over the step's sequences."""

    def __init__(self, config: GraniteConfig, tp: int = 1, spec: CardSpec = SPYRE,
                 formats: str | Mapping[str, str] = "fp16", kv_bytes: float = 2):
        hq, hkv, inter, vocab = shard(config, tp)
        f = weight_formats(formats)
        w = {m: format_bytes(fmt) for m, fmt in f.items()}
        if kv_bytes not in (0.5, 1, 2, 4):
            raise ValueError(f"kv_bytes must be one of 0.5, 1, 2, 4 (a format's width), got {kv_bytes}")
        h, d, L = config.hidden_size, config.head_dim, config.num_hidden_layers
        la, lm = len(config.attention_layers), len(config.mamba_layers)   # a hybrid's layer kinds
        dense = L if config.dense_mlp else 0
        self.config, self.tp, self.spec, self.formats, self.kv_bytes = config, tp, spec, f, kv_bytes
        self.vocab = config.vocab_size

        def rb(n: int, width: float = ACT_BYTES) -> float:
            return row_bytes(n, width, spec)

        qkv = (hq + 2 * hkv) * d
        per_layer = [   # kernels on the T token rows, `times` per step
            # the embedding's rows live on one card each: 1/tp of them per card
            LinearKernel("embedding", 1, 0.0, rb(h, w["embed"]) / tp, rb(h), 0.0),
            LinearKernel("rmsnorm", 2 * L, rb(h), rb(h), rb(h), 0.0),
            LinearKernel("qkv", la, h * rb(qkv, w["qkv"]), rb(h), rb(qkv), 2.0 * h * qkv, f["qkv"]),
            LinearKernel("rope", la, 0.0, rb(hq * d) + rb(hkv * d), rb(hq * d) + rb(hkv * d), 0.0),
            LinearKernel("write_kv", la, 0.0, 2 * rb(hkv * d), 2 * rb(hkv * d, kv_bytes), 0.0),
            LinearKernel("o_proj", la, hq * d * rb(h, w["o"]), rb(hq * d), rb(h), 2.0 * hq * d * h, f["o"]),
            LinearKernel("residual", 2 * L, 0.0, 2 * rb(h), rb(h), 0.0),
            LinearKernel("gate_up", dense, h * rb(2 * inter, w["gate_up"]), rb(h), rb(2 * inter),
                    4.0 * h * inter, f["gate_up"]),
            LinearKernel("swiglu", dense, 0.0, rb(2 * inter), rb(inter), 0.0),
            LinearKernel("down", dense, inter * rb(h, w["down"]), rb(inter), rb(h), 2.0 * inter * h, f["down"]),
            *self._mamba_kernels(config, lm, rb, w, f),
        ]
        e, k_e, ie = config.num_experts, config.num_experts_per_tok, config.expert_intermediate_size
        if e:
            per_layer.append(LinearKernel("router", L, h * rb(e, w["router"]), rb(h), rb(e), 2.0 * h * e, f["router"]))
        # the experts: per layer, each expert a step's rows choose has its two matrices read once
        # (the expected number of distinct experts T rows choose: E (1 - (1 - k/E)^T)), then each
        # row's k experts: x in, gate/up, SwiGLU, down out, 6 h IE operations
        self._experts = (L, e, k_e, h * rb(2 * ie, w["experts"]) + ie * rb(h, w["experts"]),
                         k_e * (2 * rb(h) + rb(2 * ie) + 2 * rb(ie)), k_e * rb(h), 6.0 * k_e * h * ie,
                         f["experts"]) if e else None
        m = config.mamba
        # a Mamba layer's states, read and written once a step by each of its sequences
        self._state_bytes = lm * 2 * STATE_BYTES * m.state_values if m and lm else 0
        per_logit_row = [   # kernels on the logit rows
            LinearKernel("rmsnorm", 1, rb(h), rb(h), rb(h), 0.0),
            LinearKernel("lm_head", 1, h * rb(vocab, w["lm_head"]), rb(h), rb(vocab), 2.0 * h * vocab,
                    f["lm_head"]),
            LinearKernel("sampling", 1, 0.0, SAMPLING_PASSES * rb(self.vocab), OUTPUT_BYTES_PER_ROW, 0.0),
        ]
        self._token_kernels, self._row_kernels = per_layer, per_logit_row
        self._layers = la
        self._kv_per_token = 2 * hkv * d * kv_bytes     # K and V of one token, one layer
        self._attn_rows = rb(hq * d)                     # q read, out written, per row
        self._attn_flops = 4.0 * hq * d                  # QK^T and PV per (query, key) pair
        self._allreduces = 2 * L + (1 if tp > 1 else 0)  # O and down each layer; the embedding
        self._row_h = rb(h)
        self._row_vocab = rb(vocab)
        # each LoRA module on this card's shard (q, k, v, gate, up split by columns like their
        # projections, o and down by rows): (K, N)
        self._lora_dims = {"q_proj": (h, hq * d), "k_proj": (h, hkv * d), "v_proj": (h, hkv * d),
                           "o_proj": (hq * d, h), "gate_proj": (h, inter), "up_proj": (h, inter),
                           "down_proj": (inter, h)}

    @staticmethod
    def _mamba_kernels(config: GraniteConfig, lm: int, rb, w, f) -> list[LinearKernel]:
        """A Mamba-2 layer's kernels on the token rows (`lm` such layers): in_proj, the conv (K
        multiply-adds a channel), the scan (per row its x, B, C and dt read, y written, about
        5 DI N operations: the state's decay, update and the output's dot products; the states'
        own bytes are priced per sequence in `project`), the gated norm, out_proj."""
        m = config.mamba
        if not m or not lm:
            return []
        h, di, c, gn = config.hidden_size, m.d_inner, m.conv_dim, m.n_groups * m.d_state
        return [
            LinearKernel("mamba_in", lm, h * rb(m.proj, w["mamba_in"]), rb(h), rb(m.proj), 2.0 * h * m.proj,
                         f["mamba_in"]),
            LinearKernel("mamba_conv", lm, 0.0, rb(c), rb(c), 2.0 * m.d_conv * c),
            LinearKernel("ssm_scan", lm, 0.0, rb(di + 2 * gn + m.n_heads), rb(di), 5.0 * di * m.d_state),
            LinearKernel("mamba_norm", lm, rb(di), 2 * rb(di), rb(di), 0.0),
            LinearKernel("mamba_out", lm, di * rb(h, w["mamba_out"]), rb(di), rb(h), 2.0 * di * h, f["mamba_out"]),
        ]

    def _linear(self, k: LinearKernel, rows: int) -> float:
        return linear_seconds(k, rows, self.spec)

    def project(self, step: StepShape) -> StepCost:
        """The step's seconds on the card, by kernel (KERNELS)."""
        spec, t, r = self.spec, step.tokens, step.logit_rows
        out = dict.fromkeys(KERNELS, 0.0)
        for k in self._token_kernels:
            out[k.name] += k.times * self._linear(k, t)
        for k in self._row_kernels:
            out[k.name] += k.times * self._linear(k, r)
        kv_tokens, pairs = 0, 0.0
        for q, c in zip(step.queries, step.contexts, strict=True):
            kv_tokens += padded(c, KV_BLOCK)
            pairs += q * (c - q) + q * (q + 1) / 2          # causal: query i sees c - q + i + 1 keys
        if t == 0:                                          # nothing launched
            return StepCost(0.0, out)
        written = t * self._attn_rows                       # q read, the output written
        out["attention"] = self._layers * kernel_seconds(
            kv_tokens * self._kv_per_token + 2 * written, pairs * self._attn_flops, "fp16", spec,
            written)
        if step.adapters:
            out["lora"] = self._layers * self._adapters(step.adapters)
        if self._state_bytes:
            out["ssm_scan"] += kernel_seconds(step.seqs * self._state_bytes, 0.0, "fp16", spec)
        if self._experts:
            layers, e, k_e, weight, read, written, flops, fmt = self._experts
            hit = e * (1.0 - (1.0 - k_e / e) ** t)
            out["experts"] = layers * kernel_seconds(hit * weight + t * (read + written), t * flops, fmt, spec,
                                                     t * written)
        out["all_reduce"] = self._allreduces * allreduce_seconds(t * self._row_h, self.tp, spec)
        if r:
            out["logits_gather"] = allgather_seconds(r * self._row_vocab * self.tp, self.tp, spec)
        host = (t * INPUT_BYTES_PER_ROW + step.seqs * INPUT_BYTES_PER_SEQ
                + kv_tokens // KV_BLOCK * INPUT_BYTES_PER_BLOCK + r * OUTPUT_BYTES_PER_ROW)
        return step_cost(out, host, spec)

    def seconds(self, step: StepShape) -> float:
        """The step's seconds on the card."""
        return self.project(step).seconds

    def _adapters(self, adapters: tuple[AdapterRows, ...]) -> float:
        """One layer's LoRA kernels: each adapter's targeted modules over its rows. Per module
        A [r, K] and B^T [r, N] in fp16, read once per adapter; per row x [K] read, the [r]
        product written and read, y [N] read and written."""
        def rb(n: int) -> float:
            return row_bytes(n, ACT_BYTES, self.spec)

        total = 0.0
        for a in adapters:
            for m in a.modules:
                k, n = self._lora_dims[m]
                weight, read, written = a.rank * (rb(k) + rb(n)), rb(k) + rb(a.rank) + rb(n), rb(a.rank) + rb(n)
                total += kernel_seconds(weight + a.rows * (read + written), a.rows * 2.0 * a.rank * (k + n),
                                        "fp16", self.spec, a.rows * written)
        return total

    @classmethod
    def of_weights(cls, config: GraniteConfig, weights, kv_cache_dtype: str, tp: int = 1,
                   spec: CardSpec = SPYRE) -> StepProjector:
        """The projector of a model as placed (models.step.weights.ModelWeights: each matrix's
        format as the card holds it; its first layer's stand for every layer) with its KV
        cache's format."""
        def first(attr: str):
            return next((getattr(lw, attr) for lw in weights.layers if getattr(lw, attr) is not None), None)

        attention, mamba = first("qkv") and first("o"), first("mamba")
        dense, experts = first("gate_up"), first("experts")
        names = {"embed": weights.embed, "lm_head": weights.lm_head,
                 **({"qkv": first("qkv"), "o": first("o")} if attention else {}),
                 **({"gate_up": dense, "down": first("down")} if dense else {}),
                 **({"mamba_in": mamba.in_proj, "mamba_out": mamba.out_proj} if mamba else {}),
                 **({"router": experts.router, "experts": experts.gate_up[0]} if experts else {})}
        return cls(config, tp, spec, {m: gw.format_name for m, gw in names.items()},
                   format_bytes(kv_cache_dtype))


def project_step(config: GraniteConfig, step: StepShape, tp: int = 1, spec: CardSpec = SPYRE,
                 formats: str | Mapping[str, str] = "fp16", kv_bytes: float = 2) -> StepCost:
    """One step of `config` on `tp` cards (weights in `formats`, KV cache values of `kv_bytes`)."""
    return StepProjector(config, tp, spec, formats, kv_bytes).project(step)


def project_request(config: GraniteConfig, prompt_tokens: int, output_tokens: int, batch: int,
                    tp: int = 1, chunk: int = 512, spec: CardSpec = SPYRE,
                    formats: str | Mapping[str, str] = "fp16",
                    kv_bytes: float = 2, lora: tuple[int, int] | None = None) -> tuple[float, float]:
    """(TTFT, TPOT) of a request of `prompt_tokens` generating `output_tokens` on the card, as
    the vLLM Spyre plugin runs it: its prefill alone, in chunks of `chunk` tokens (a multiple of
    the 64-token block), one step each, the last sampling the first token (TTFT: their sum, the
    request's own: one prefill at a time, never beside decodes, so the k-th of a batch arriving
    together waits for k - 1 prefills before it); then one decode step per later token beside
    `batch` - 1 others at the same context (TPOT: their mean; 0 for a single token). With
    `lora` (adapters, rank) every sequence runs an adapter targeting every module, the batch
    spread evenly over min(adapters, batch) of them."""
    if output_tokens < 1 or batch < 1:
        raise ValueError(f"project_request: output_tokens {output_tokens} and batch {batch} "
                         "must be >= 1")
    adapters, rank = lora or (0, 0)
    projector = StepProjector(config, tp, spec, formats, kv_bytes)

    def with_adapters(step: StepShape) -> StepShape:
        n = min(adapters, step.seqs)
        rows = [step.tokens // n + (i < step.tokens % n) for i in range(n)] if n else []
        return replace(step, adapters=tuple(AdapterRows(r, LORA_MODULES, rank) for r in rows))

    ttft = sum(projector.seconds(with_adapters(step)) for step in prefill_steps(prompt_tokens, chunk))
    decodes = [projector.seconds(with_adapters(decode_step(batch, prompt_tokens + k)))
               for k in range(1, output_tokens)]
    return ttft, sum(decodes) / len(decodes) if decodes else 0.0
