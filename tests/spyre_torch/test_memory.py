"""Tensor memory on the card: torch.spyre's statistics from the card's caching allocator."""

from __future__ import annotations

import pytest
import torch

from spyre_torch.memory import DEVICE_BASE
from tests.spyre_torch.processes import gate, run_python


@pytest.fixture(autouse=True)
def settled():
    """Start each test with the card idle and every waiting block freed."""
    torch.ones(1, device="spyre").add_(1)  # the fill and add programs exist already
    torch.spyre.empty_cache()
    yield


def test_allocated_moves_as_tensors_come_and_go_and_returns_after_del_and_empty_cache():
    start, reserved = torch.spyre.memory_allocated(), torch.spyre.memory_reserved()
    x = torch.empty(1000, device="spyre")           # 4000 bytes: 32 sticks of 128
    assert torch.spyre.memory_allocated() == start + 4096
    y = torch.ones(10, 10, device="spyre")
    assert torch.spyre.memory_allocated() == start + 4096 + 512
    assert torch.spyre.memory_reserved() >= torch.spyre.memory_allocated()
    del x
    assert torch.spyre.memory_allocated() == start + 512
    del y
    torch.spyre.empty_cache()
    assert torch.spyre.memory_allocated() == start
    assert torch.spyre.memory_reserved() == reserved


def test_a_view_keeps_the_block_until_the_last_view_goes():
    start = torch.spyre.memory_allocated()
    x = torch.zeros(64, device="spyre")
    v = x[8:].view(7, 8)
    del x
    assert torch.spyre.memory_allocated() == start + 256
    del v
    torch.spyre.empty_cache()
    assert torch.spyre.memory_allocated() == start


def test_peak_and_its_reset():
    torch.spyre.reset_peak_memory_stats()
    base = torch.spyre.max_memory_allocated()
    x = torch.empty(1 << 16, device="spyre")
    del x
    assert torch.spyre.max_memory_allocated() == base + (1 << 18)
    torch.spyre.reset_peak_memory_stats()
    assert torch.spyre.max_memory_allocated() == torch.spyre.memory_allocated()


def test_a_block_queued_work_still_reads_is_not_handed_out_again_before_the_stream_passes():
    s = torch.spyre.Stream()
    opened = gate(s)
    with torch.spyre.stream(s):
        x = torch.ones(256, device="spyre")        # its fill is queued behind the gate
        addr = x.data_ptr()
        y = x * 2
    reserved = torch.spyre.memory_reserved()
    del x                                           # the tensor is gone, its block still in use
    assert torch.spyre.memory_reserved() == reserved
    assert torch.spyre.memory_stats()["pending_frees"] >= 1
    with torch.spyre.stream(s):
        z = torch.empty(256, device="spyre")
    assert z.data_ptr() != addr
    opened.set()
    torch.spyre.empty_cache()
    assert torch.spyre.memory_stats()["pending_frees"] == 0
    assert y.cpu().tolist() == [2.0] * 256


def test_memory_stats_and_mem_get_info_have_torch_cudas_shape():
    stats = torch.spyre.memory_stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                "reserved_bytes.all.current", "num_ooms"):
        assert key in stats
    free, total = torch.spyre.mem_get_info()
    assert total == torch.spyre.get_device_properties().total_memory and 0 < free <= total


def test_a_tensor_too_big_for_the_card_is_refused_with_the_numbers():
    r = run_python("import torch\n"
                   "try:\n    torch.empty(8 << 20, device='spyre')\n"
                   "except torch.OutOfMemoryError as e:\n    print('OOM', e)\n"
                   "print(torch.spyre.memory_stats()['num_ooms'])",
                   env={"SPYRE_SERVE_DEVICE_MEMORY": "16M"})
    assert r.returncode == 0, r.stderr
    assert "OOM spyre:0: device out of memory: requested 33554432 bytes" in r.stdout
    assert r.stdout.strip().endswith("1")


def test_module_weights_are_counted():
    start = torch.spyre.memory_allocated()
    m = torch.nn.Linear(256, 128).to("spyre")
    assert torch.spyre.memory_allocated() == start + 256 * 128 * 4 + 512
    assert m.weight.data_ptr() >= DEVICE_BASE
    del m
    torch.spyre.empty_cache()
    assert torch.spyre.memory_allocated() == start


def test_record_stream_keeps_a_block_until_the_other_stream_passes():
    s = torch.spyre.Stream()
    x = torch.ones(256, device="spyre")             # made on the default stream, which idles
    torch.spyre.synchronize()
    opened = gate(s)
    with torch.spyre.stream(s):
        y = x * 2                                   # ... but read on s, still held
    x.record_stream(s)
    del x
    assert torch.spyre.memory_stats()["pending_frees"] >= 1
    opened.set()
    torch.spyre.empty_cache()
    assert torch.spyre.memory_stats()["pending_frees"] == 0
    assert y.cpu().tolist() == [2.0] * 256
