"""The real card's clock (device/cost_model.py) on hand-computed cases: the published figures
it derives its rates from, a GEMM that is bandwidth-bound and one that is compute-bound, stick
padding, and the collectives between cards."""

from __future__ import annotations

import pytest

from spyre_serve.device import cost_model as cm
from spyre_serve.device.cost_model import (
    SPYRE,
    CardSpec,
    allgather_seconds,
    allreduce_seconds,
    format_bytes,
    kernel_seconds,
    memory_seconds,
    padded,
    row_bytes,
)

GB = 1e9
TURN = 2 / (105 * GB) - 2 / (150 * GB)   # seconds per byte of min(read, written), by hand


def test_the_rates_follow_from_the_published_figures():
    assert cm.PEAK_MACS_PER_NS_PER_CORE == 1536                 # 2 corelets x 8x8 PEs x 8 lanes x 1.5
    assert cm.PEAK_FP16_FLOPS == pytest.approx(98.304e12)       # 32 cores x 1536 MAC/ns x 2
    assert SPYRE.fp16_flops == pytest.approx(72.96e12)          # 32 x 1140 MAC/ns x 2
    assert SPYRE.int8_ops == pytest.approx(300e12 * 1140 / 1536)
    assert SPYRE.memory_bw == 150 * GB and SPYRE.link_bw == 64 * GB
    # the turnaround makes a balanced read+write run at the measured 105 GB/s, one way at 150
    assert memory_seconds(1e9, 1e9) == pytest.approx(2e9 / (105 * GB))
    assert memory_seconds(1e9, 0) == pytest.approx(1e9 / (150 * GB))


def test_a_decode_gemm_is_bandwidth_bound():
    # one row through a 4096 x 4096 fp16 weight: 32 MiB of weight and an 8 KiB row read, 8 KiB written
    read, written = 4096 * 4096 * 2 + 4096 * 2, 4096 * 2
    flops = 2 * 4096 * 4096                                     # 0.46 us at 72.96 TFLOPS
    expected = (read + written) / (150 * GB) + TURN * written   # 223.85 us
    got = kernel_seconds(read + written, flops, "fp16", SPYRE, written=written)
    assert got == pytest.approx(expected) and got == pytest.approx(223.85e-6, rel=1e-4)
    assert flops / SPYRE.fp16_flops < got / 100


def test_a_prefill_gemm_is_compute_bound_at_its_formats_rate():
    # 4096 rows through the same weight: 2 x 4096^3 FLOPs, 96 MiB moved (0.67 ms)
    flops, moved = 2 * 4096 ** 3, 3 * 4096 * 4096 * 2
    assert kernel_seconds(moved, flops, "fp16") == pytest.approx(137_438_953_472 / 72.96e12)  # 1.88 ms
    assert kernel_seconds(moved, flops, "bfloat16") == kernel_seconds(moved, flops, "dlfloat16")
    int8 = kernel_seconds(moved / 2, flops, "int8")
    assert int8 == pytest.approx(137_438_953_472 / (300e12 * 1140 / 1536))                # 0.62 ms
    assert kernel_seconds(moved / 2, flops, "Q4_1") == int8       # int4 computes as int8


def test_stick_padding_rounds_inner_dimensions_to_whole_sticks():
    assert padded(49159) == 49216 and padded(4096) == 4096 and padded(1) == 64
    assert padded(100, 32) == 128
    assert row_bytes(49159, 2) == 49216 * 2                      # 64 fp16 values a stick
    assert row_bytes(100, 1) == 128                              # 128 int8 values a stick
    assert row_bytes(100, 4) == 128 * 4                          # 32 fp32 values a stick
    assert row_bytes(100, 0.5) == 128                            # 256 int4 values a stick
    assert [format_bytes(f) for f in ("fp16", "float32", "FP8_E4M3", "Q8_0", "Q4_0")] == [2, 4, 1, 1, 0.5]


def test_the_all_reduce_of_a_decode_row_at_tp_2_and_4():
    row = 4096 * 2                                               # one [1, 4096] fp16 activation
    assert allreduce_seconds(row, 1) == 0.0
    # 2 (N - 1) ring steps, each 10 us and nbytes / N over a 64 GB/s link
    assert allreduce_seconds(row, 2) == pytest.approx(2 * (10e-6 + 4096 / (64 * GB)))     # 20.13 us
    assert allreduce_seconds(row, 4) == pytest.approx(6 * (10e-6 + 2048 / (64 * GB)))     # 60.19 us
    assert allgather_seconds(row, 2) == pytest.approx(10e-6 + 4096 / (64 * GB))
    # a prefill chunk's [512, 4096] fp16: bandwidth, not latency, now counts
    assert allreduce_seconds(512 * row, 2) == pytest.approx(2 * (10e-6 + 2 * 1024 * 1024 / (64 * GB)))


def test_a_spec_of_other_figures_prices_with_them():
    slow = CardSpec(memory_bw=75 * GB, turnaround_seconds_per_byte=0.0, launch_seconds=0.0)
    assert kernel_seconds(75e9, 0, "fp16", slow) == pytest.approx(1.0)
    assert kernel_seconds(150e9, 0) == pytest.approx(1.0)


def test_refusals_name_what_is_wrong():
    with pytest.raises(ValueError, match="unknown format 'fp64'"):
        kernel_seconds(1, 1, "fp64")
    with pytest.raises(ValueError, match="written 5"):
        kernel_seconds(1, 0, "fp16", written=5)
    with pytest.raises(ValueError, match="memory_bw"):
        CardSpec(memory_bw=0)
    with pytest.raises(ValueError, match="cards must be >= 1, got 0"):
        allreduce_seconds(1, 0)
