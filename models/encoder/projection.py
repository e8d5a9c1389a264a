"""The real card's clock for one step of the encoder (models/encoder/program.py): RoBERTa/XLM-R
embeddings, priced kernel by kernel as models/sizing/projection.py prices a generating step (the same
card figures, device/cost_model.py; rows in whole 128-byte sticks; activations fp16):

    embedding (word + position rows, the token type's once), layernorm
    per layer: QKV GEMM, bias, bidirectional attention over each whole prompt, O GEMM, bias,
               residual, layernorm, up GEMM, bias, GELU, down GEMM, bias, residual, layernorm
    pooling (one row a sequence: CLS or LAST; every row: MEAN), the host link, the launch

An encoder runs on one card and holds no KV cache: each prompt is computed whole in one step,
so a sequence's queries are its context (a StepShape from `step_of_work` of its work list) and
its attention reads its own K and V rows from the step's QKV buffer.

    EncoderProjector(config, formats, pooling_type).project(step) -> StepCost (ENCODER_KERNELS)
    EncoderProjector.of_weights(config, weights, pooling_type)        # as the runner placed them
"""

from __future__ import annotations

from collections.abc import Mapping

from spyre_serve.device.cost_model import (
    SPYRE,
    CardSpec,
    format_bytes,
    format_name,
    kernel_seconds,
    row_bytes,
)
from spyre_serve.models.encoder.config import EncoderConfig
from spyre_serve.models.sizing.projection import (
    ACT_BYTES,
    LinearKernel,
    StepCost,
    StepProjector,
    StepShape,
    linear_seconds,
    step_cost,
)

ENCODER_MATRICES = ("embed", "qkv", "o", "up", "down")
ENCODER_KERNELS = ("embedding", "layernorm", "qkv", "bias", "attention", "o_proj", "residual",
                   "up", "gelu", "down", "pooling", "pcie", "launch")
# what the host copies per step (models/encoder/program.py's INPUTS and OUTPUTS): per token row its
# token and position (int32 each), per sequence its first row (int32, and one more for the end),
# back per sequence its pooled row (float32 [H])
INPUT_BYTES_PER_ROW, INPUT_BYTES_PER_SEQ, POOLED_BYTES_PER_VALUE = 8, 4, 4


class EncoderProjector:
    """The kernels of an encoder's step, priced once per row (one card)."""

    def __init__(self, config: EncoderConfig, formats: str | Mapping[str, str] = "fp16",
                 pooling_type: str = "CLS", spec: CardSpec = SPYRE):
        if isinstance(formats, str):
            formats = dict.fromkeys(ENCODER_MATRICES, formats)
        unknown = set(formats) - set(ENCODER_MATRICES)
        if unknown:
            raise ValueError(f"unknown matrices {sorted(unknown)}: the encoder's are "
                             f"{list(ENCODER_MATRICES)}")
        f = {m: format_name(formats.get(m, "fp16")) for m in ENCODER_MATRICES}
        self.config, self.formats, self.pooling_type, self.spec = config, f, pooling_type, spec
        h, inter, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers

        def rb(n: int, fmt: str | None = None) -> float:
            return row_bytes(n, ACT_BYTES if fmt is None else format_bytes(fmt), spec)

        def gemm(name: str, n_in: int, n_out: int, fmt: str) -> LinearKernel:
            """[T, n_in] @ W[n_in, n_out]: the weight once, a row in and out."""
            return LinearKernel(name, L, n_in * rb(n_out, fmt), rb(n_in), rb(n_out),
                                2.0 * n_in * n_out, fmt)

        def bias(n: int) -> LinearKernel:
            """A bias added to a GEMM's [T, n] output: the bias once, a row in and out."""
            return LinearKernel("bias", L, rb(n), rb(n), rb(n), 0.0)

        self._kernels = [   # kernels on the T token rows, `times` per step
            # a token's word and position rows in, its row out; the token type's row read once
            LinearKernel("embedding", 1, rb(h, f["embed"]), 2 * rb(h, f["embed"]), rb(h), 0.0),
            # the embeddings' and two a layer: weight and bias once, a row in and out
            LinearKernel("layernorm", 2 * L + 1, 2 * rb(h), rb(h), rb(h), 0.0),
            gemm("qkv", h, 3 * h, f["qkv"]), bias(3 * h),
            gemm("o_proj", h, h, f["o"]), bias(h),
            LinearKernel("residual", 2 * L, 0.0, 2 * rb(h), rb(h), 0.0),
            gemm("up", h, inter, f["up"]), bias(inter),
            LinearKernel("gelu", L, 0.0, rb(inter), rb(inter), 0.0),
            gemm("down", inter, h, f["down"]), bias(h),
        ]
        self._layers, self._row_h, self._h = L, rb(h), h

    def project(self, step: StepShape) -> StepCost:
        """The step's seconds on the card, by kernel (ENCODER_KERNELS)."""
        spec, t, s = self.spec, step.tokens, step.seqs
        out = dict.fromkeys(ENCODER_KERNELS, 0.0)
        if t == 0:                                          # nothing launched
            return StepCost(0.0, out)
        for k in self._kernels:
            out[k.name] += k.times * linear_seconds(k, t, spec)
        # bidirectional: each of a prompt's q rows sees its q keys; q, k and v rows in, a row out
        pairs = sum(q * q for q in step.queries)
        written = t * self._row_h
        out["attention"] = self._layers * kernel_seconds(
            4 * written, 4.0 * self._h * pairs, "fp16", spec, written)   # QK^T and PV: 2 x 2 H
        read = (t if self.pooling_type == "MEAN" else s) * self._row_h
        out["pooling"] = kernel_seconds(read + s * self._row_h, 0.0, "fp16", spec, s * self._row_h)
        host = (t * INPUT_BYTES_PER_ROW + (s + 1) * INPUT_BYTES_PER_SEQ
                + s * self._h * POOLED_BYTES_PER_VALUE)
        return step_cost(out, host, spec)

    seconds = StepProjector.seconds     # the step's seconds on the card

    @classmethod
    def of_weights(cls, config: EncoderConfig, weights, pooling_type: str = "CLS",
                   spec: CardSpec = SPYRE) -> EncoderProjector:
        """The projector of an encoder as placed (models.encoder.weights.EncoderWeights: each
        GEMM's format as the card holds it, its first layer's for every layer; the embedding
        tables float32)."""
        layer = weights.layers[0]
        names = {"qkv": layer.qkv, "o": layer.o, "up": layer.up, "down": layer.down}
        return cls(config, {"embed": "fp32", **{m: gw.format_name for m, gw in names.items()}},
                   pooling_type, spec)
