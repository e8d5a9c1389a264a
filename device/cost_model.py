"""A real Spyre card's clock: how long a kernel, a collective and a step's launch take on the
card, from its published figures. The emulator's own time is this host's; this is the card's.

Every figure is one named constant with its source. The sources (cited in docs/projection.md):

  [TS-ARCH]  torch-spyre, docs/source/architecture/spyre_accelerator.md: 32 cores, two corelets
             each (an 8x8 systolic PE array), 128 GB LPDDR5, "300+ TOPS", PCIe Gen5 x16,
             BYTES_IN_STICK = 128
  [TS-COST]  torch-spyre, torch_spyre/_inductor/cost_model.py (CostParams, calibrated on the
             card): T = max(compute, HBM); HBM = (R + W) / 150 GB/s + a turnaround penalty on
             min(R, W) that brings a balanced read+write to ~105 GB/s; matmul compute at a
             sustained 1140 MAC/ns/core; no fixed term per kernel ("fill ~ 0")
  [DESIGN]   docs/spyre-fidelity.md, the hardware table (~1.5 GHz, 204.8 GB/s nominal, ~98.3
             TFLOPS fp16 peak, inner dimensions padded to 64)
  [PCIE]     PCI-SIG, PCIe 5.0: 32 GT/s per lane, 128b/130b encoding

A figure no source gives (a step launch's fixed cost, a collective's latency per ring step,
the sustained rate of formats the cost model does not calibrate) is an ASSUMPTION: named so,
with its reasoning beside it.

    kernel_seconds(bytes_moved, flops, fmt, spec)   max(memory time, compute time) of one kernel
    allreduce_seconds(nbytes, cards, spec)          a ring all-reduce of nbytes over cards
    allgather_seconds(nbytes, cards, spec)          a ring all-gather of nbytes (the whole result)
    padded(n, multiple)                             n rounded up to a whole stick of elements
    row_bytes(n, width)                             bytes of a row of n values of width bytes,
                                                    in whole 128-byte sticks
"""

from __future__ import annotations

from dataclasses import dataclass

from spyre_serve.device.memory import STICK

# ---- the card [TS-ARCH], [DESIGN] ---------------------------------------------------------
CORES = 32                       # AI cores a card [TS-ARCH]
CLOCK_HZ = 1.5e9                 # ~1.5 GHz [DESIGN]
CORELETS_PER_CORE = 2            # each an 8x8 systolic PE array [TS-ARCH]
PES_PER_CORELET = 8 * 8
SIMD_PER_PE = 8                  # lanes per PE: 32 x 2 x 64 x 8 x 1.5 GHz x 2 = 98.3 TFLOPS [DESIGN]
# peak fp16 multiply-accumulates per ns per core: 2 x 64 x 8 x 1.5 = 1536 [TS-COST]
PEAK_MACS_PER_NS_PER_CORE = CORELETS_PER_CORE * PES_PER_CORELET * SIMD_PER_PE * CLOCK_HZ / 1e9
SUSTAINED_MACS_PER_NS_PER_CORE = 1140.0   # matmul's sustained rate (CostParams mac_peak) [TS-COST]
PEAK_FP16_FLOPS = CORES * PEAK_MACS_PER_NS_PER_CORE * 1e9 * 2            # 98.3e12 [DESIGN]
SUSTAINED_FP16_FLOPS = CORES * SUSTAINED_MACS_PER_NS_PER_CORE * 1e9 * 2  # 72.96e12
SUSTAINED_FRACTION = SUSTAINED_MACS_PER_NS_PER_CORE / PEAK_MACS_PER_NS_PER_CORE   # 0.742
PEAK_INT8_OPS = 300e12           # "300+ TOPS" a card [TS-ARCH]
# ASSUMPTION: int8 sustains the fraction of its peak fp16 sustains (no int8 calibration published)
SUSTAINED_INT8_OPS = PEAK_INT8_OPS * SUSTAINED_FRACTION                  # 222.7e12

# ---- device memory [DESIGN], [TS-COST] -----------------------------------------------------
MEMORY_BW_NOMINAL = 204.8e9      # bytes/s, LPDDR5 nominal [DESIGN] (for reference: never reached)
MEMORY_BW_ONE_WAY = 150e9        # bytes/s measured read-only or write-only (CostParams bw_peak) [TS-COST]
MEMORY_BW_READ_WRITE = 105e9     # bytes/s measured at balanced read+write [TS-COST]
# The bus turns around between reads and writes: a kernel that reads R and writes W bytes pays
# this per byte of min(R, W) on top of (R + W) / MEMORY_BW_ONE_WAY; solved so that R = W runs at
# MEMORY_BW_READ_WRITE: 2 / 105 - 2 / 150 ns per byte (CostParams rw_turnaround) [TS-COST]
TURNAROUND_SECONDS_PER_BYTE = 2 / MEMORY_BW_READ_WRITE - 2 / MEMORY_BW_ONE_WAY
KERNEL_FIXED_SECONDS = 0.0       # no fixed term per kernel: the fitted intercept is ~0 [TS-COST]

# ---- layout [TS-ARCH], [DESIGN] -----------------------------------------------------------
STICK_BYTES = STICK              # 128 bytes: the unit of memory <-> scratchpad transfer [TS-ARCH]
STICK_FP16 = STICK_BYTES // 2    # 64 fp16 values: inner dimensions are padded to 64 [DESIGN]

# ---- the host link and several cards [TS-ARCH], [PCIE] -------------------------------------
# PCIe Gen5 x16: 32 GT/s x 16 lanes / 8 = 64 GB/s per direction NOMINAL (63 GB/s after
# 128b/130b encoding, less after packet headers): an upper bound, so the collectives projected
# with it are optimistic on bandwidth [PCIE]
PCIE_BW = 64e9
# ASSUMPTION: one step of a ring collective between cards costs 10 us beside its bytes: a
# peer-to-peer DMA over PCIe has a latency of a few microseconds, and each step also waits for
# its peer's event and adds the received shard; GPU collective libraries over PCIe show small
# all-reduces of this order. Nothing published for Spyre.
COLLECTIVE_STEP_SECONDS = 10e-6
# ASSUMPTION: a step program's launch costs 50 us beside its kernels: the job plan's host-compute
# (the correction blob), its copy to the card, the D2H of the samples (DMAs of a few us each)
# and the completion's interrupt. Kernels add no fixed term [TS-COST], so this is the step's.
# The vLLM Spyre plugin's SIM_MODE advances a constant per step too [DESIGN].
STEP_LAUNCH_SECONDS = 50e-6

# ---- formats: bytes a value and the compute rate it runs at ---------------------------------
# The card's formats [DESIGN]: fp16 (DLFloat16 on the card), bf16, fp32, FP8 E4M3/E5M2, INT8,
# INT4. The systolic arrays multiply 16-bit values [TS-COST's rate is fp16's].
FORMAT_BYTES = {"fp16": 2, "bf16": 2, "dlfloat16": 2, "fp32": 4, "fp8": 1, "int8": 1, "int4": 0.5}
# the names the emulator's weights use (device.layout's format names) for the same formats
# (ASSUMPTION: a 5- or 6-bit K-quant runs on the card as int8, the narrowest format holding it)
FORMAT_ALIASES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "FP8_E4M3": "fp8",
                  "Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q5_K": "int8",
                  "Q6_K": "int8", "Q6_K_MIN": "int8"}
# ASSUMPTION: fp32 and fp8 matrices are widened to 16 bits in the core (the arrays are fp16's),
# and int4 to int8: each computes at the rate of the width it is widened to
INT_FORMATS = ("int8", "int4")


def format_name(fmt: str) -> str:
    """The card's name of a format ("fp16", "int8", ...), from it or an alias ("float16",
    "Q8_0", ...); ValueError naming the known ones."""
    name = FORMAT_ALIASES.get(fmt, fmt)
    if name not in FORMAT_BYTES:
        raise ValueError(f"unknown format {fmt!r}: the card's are {sorted(FORMAT_BYTES)} "
                         f"(or {sorted(FORMAT_ALIASES)})")
    return name


def format_bytes(fmt: str) -> float:
    """Bytes of one value of `fmt` (int4: 0.5)."""
    return FORMAT_BYTES[format_name(fmt)]


@dataclass(frozen=True, slots=True)
class CardSpec:
    """One card's figures, as the projection uses them (SPYRE: the constants above)."""

    cores: int = CORES
    clock_hz: float = CLOCK_HZ
    memory_bw: float = MEMORY_BW_ONE_WAY                 # bytes/s a kernel streams at
    turnaround_seconds_per_byte: float = TURNAROUND_SECONDS_PER_BYTE
    fp16_flops: float = SUSTAINED_FP16_FLOPS             # sustained, 16-bit GEMMs
    int8_ops: float = SUSTAINED_INT8_OPS                 # sustained, int8 GEMMs
    kernel_fixed_seconds: float = KERNEL_FIXED_SECONDS
    link_bw: float = PCIE_BW                             # bytes/s per direction, host or peer
    collective_step_seconds: float = COLLECTIVE_STEP_SECONDS
    launch_seconds: float = STEP_LAUNCH_SECONDS
    stick_bytes: int = STICK_BYTES

    def __post_init__(self) -> None:
        for name in ("memory_bw", "fp16_flops", "int8_ops", "link_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CardSpec.{name} must be positive, got {getattr(self, name)!r}")

    def peak_of(self, fmt: str) -> float:
        """Sustained operations per second of a GEMM whose weight is in `fmt`."""
        return self.int8_ops if format_name(fmt) in INT_FORMATS else self.fp16_flops


SPYRE = CardSpec()


def padded(n: int, multiple: int = STICK_FP16) -> int:
    """`n` rounded up to a multiple of `multiple` (an inner dimension padded to whole sticks:
    64 fp16 values by default)."""
    if multiple < 1:
        raise ValueError(f"padded: multiple must be positive, got {multiple}")
    return -(-n // multiple) * multiple


def row_bytes(n: int, width: float, spec: CardSpec = SPYRE) -> float:
    """Bytes of a row of `n` values of `width` bytes laid out in whole sticks (an inner
    dimension padded to the values a stick holds: 64 at 2 bytes, 128 at 1)."""
    per_stick = int(spec.stick_bytes / width)
    return padded(n, per_stick) * width


def memory_seconds(read: float, written: float, spec: CardSpec = SPYRE) -> float:
    """Seconds to read `read` and write `written` bytes of device memory: (R + W) at the
    one-way rate plus the bus's turnaround on min(R, W) [TS-COST]."""
    return (read + written) / spec.memory_bw + spec.turnaround_seconds_per_byte * min(read, written)


def kernel_seconds(bytes_moved: float, flops: float, fmt: str = "fp16", spec: CardSpec = SPYRE,
                   written: float = 0.0) -> float:
    """One kernel: max(bytes_moved / bandwidth, flops / sustained rate of `fmt`), the memory
    time with the turnaround on the `written` part of `bytes_moved` (0: all read), plus the
    kernel's fixed cost (0 [TS-COST]). ValueError for negative amounts."""
    if bytes_moved < 0 or flops < 0 or not 0 <= written <= bytes_moved:
        raise ValueError(f"kernel_seconds: bytes_moved {bytes_moved}, written {written} and flops "
                         f"{flops} must be >= 0, written at most bytes_moved")
    memory = memory_seconds(bytes_moved - written, written, spec)
    return spec.kernel_fixed_seconds + max(memory, flops / spec.peak_of(fmt))


def allreduce_seconds(nbytes: float, cards: int, spec: CardSpec = SPYRE) -> float:
    """A ring all-reduce of `nbytes` over `cards` cards: a reduce-scatter then an all-gather,
    2 (N - 1) steps each moving nbytes / N over a link (both directions at once), each step
    with its latency. 0 on one card."""
    if cards < 1:
        raise ValueError(f"allreduce_seconds: cards must be >= 1, got {cards}")
    steps = 2 * (cards - 1)
    return steps * (spec.collective_step_seconds + nbytes / cards / spec.link_bw)


def allgather_seconds(nbytes: float, cards: int, spec: CardSpec = SPYRE) -> float:
    """A ring all-gather whose result is `nbytes` (each card holds nbytes / N): N - 1 steps."""
    if cards < 1:
        raise ValueError(f"allgather_seconds: cards must be >= 1, got {cards}")
    return (cards - 1) * (spec.collective_step_seconds + nbytes / cards / spec.link_bw)
