"""The "spyre" device itself: registration, the torch.spyre module, where tensors live, copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spyre_torch.memory import DEVICE_BASE
from spyre_torch.runtime import runtime
from tests.spyre_torch.processes import run_python

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]


def test_import_torch_alone_registers_the_device_without_making_the_card():
    r = run_python("import sys, torch\n"
                   "print(torch.spyre.is_available(), torch.spyre.is_initialized(),\n"
                   "      'numba' in sys.modules, torch._C._get_privateuse1_backend_name())\n"
                   "x = torch.ones(4, device='spyre')\n"
                   "print(x.device, x.sum().item(), torch.spyre.is_initialized())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["True False False spyre", "spyre:0 4.0 True"]


def test_autoload_off_leaves_torch_alone_until_spyre_torch_is_imported():
    r = run_python("import torch\n"
                   "print(hasattr(torch, 'spyre'))\n"
                   "import spyre_torch\n"
                   "print(torch.ones(2, device='spyre').cpu().tolist())",
                   env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["False", "[1.0, 1.0]"]


def test_importing_spyre_torch_before_torch_registers_once_and_quietly():
    r = run_python("import warnings\nwarnings.simplefilter('error')\n"
                   "import spyre_torch, torch\nprint(torch.zeros(1, device='spyre').device)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "spyre:0"


def test_one_card_with_the_cards_cores_and_memory():
    assert torch.spyre.is_available()
    assert torch.spyre.device_count() == 1
    assert torch.spyre.current_device() == 0
    torch.spyre.set_device(0)
    torch.spyre.set_device("spyre:0")
    props = torch.spyre.get_device_properties()
    card = runtime().card
    assert (props.cores, props.total_memory) == (card.cores, card.capacity)
    assert "Spyre" in torch.spyre.get_device_name()


def test_a_second_card_is_refused_by_name():
    with pytest.raises(RuntimeError, match="invalid device ordinal 1: there is 1 card"):
        torch.spyre.set_device(1)
    with pytest.raises(RuntimeError, match="ordinal 1.*SPYRE_DEVICE_COUNT=1"):
        torch.empty(2, device="spyre:1")


def test_a_tensor_lives_in_the_cards_arena():
    x = torch.arange(10, dtype=torch.float32).to("spyre")
    addr = x.data_ptr() - DEVICE_BASE
    card = runtime().card
    assert 0 <= addr < card.capacity and addr % 128 == 0  # a block of the caching allocator
    assert card.allocator.size_of(addr) == 128
    torch.spyre.synchronize()
    # a host view of the arena, as the device tests use: the bytes are there
    np.testing.assert_array_equal(card.f32[addr // 4: addr // 4 + 10], np.arange(10))


def test_host_code_gets_no_host_address_for_a_card_tensor():
    x = torch.ones(3, device="spyre")
    assert x.data_ptr() >= DEVICE_BASE  # a device pointer: bit 60, outside any host address space
    with pytest.raises(TypeError, match="spyre"):
        x.numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_to_spyre_and_back_keeps_every_dtype(dtype):
    src = (torch.arange(-12, 12) % 7).reshape(4, 6).to(dtype)
    back = src.to("spyre").cpu()
    assert back.dtype == dtype and torch.equal(back, src)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_copies_both_ways(dtype):
    src = (torch.arange(48) % 5).reshape(6, 8).to(dtype)
    on = src.to("spyre")
    assert torch.equal(on.t().cpu(), src.t())          # a transposed view read back
    assert torch.equal(on[:, 1::3].cpu(), src[:, 1::3])
    dst = torch.zeros(8, 6, dtype=dtype, device="spyre")
    dst.t().copy_(src)                                  # into a transposed view
    assert torch.equal(dst.cpu(), src.t())


def test_copies_are_commands_on_the_stream_and_counted():
    before = torch.spyre.counters()
    x = torch.ones(1000, dtype=torch.float32).to("spyre")
    x.cpu()
    after = torch.spyre.counters()
    assert after["h2d_bytes"] - before["h2d_bytes"] == 4000
    assert after["d2h_bytes"] - before["d2h_bytes"] == 4000


def test_copy_into_a_column_of_a_card_tensor():
    y = torch.zeros(4, 4, device="spyre")
    y[:, 1].copy_(torch.arange(4.0))
    y[2] = 7.0
    expected = torch.zeros(4, 4)
    expected[:, 1] = torch.arange(4.0)
    expected[2] = 7.0
    assert torch.equal(y.cpu(), expected)


def test_card_to_card_copy_casts():
    x = torch.tensor([1.7, -2.2, 0.0]).to("spyre")
    assert x.to(torch.int64).cpu().tolist() == [1, -2, 0]
    assert x.to(torch.bool).cpu().tolist() == [True, True, False]
    assert x.double().cpu().dtype == torch.float64


def test_item_tolist_and_printing():
    x = torch.arange(6.0).reshape(2, 3).to("spyre")
    assert x[1, 2].item() == 5.0
    assert x.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert "device='spyre:0'" in repr(x)


def test_manual_seed_makes_random_tensors_repeat():
    torch.spyre.manual_seed(3)
    a = torch.randn(5, device="spyre").cpu()
    torch.manual_seed(3)  # torch's own seeds the card's generator too
    b = torch.randn(5, device="spyre").cpu()
    assert torch.equal(a, b)


def test_module_to_spyre_moves_parameters_and_buffers():
    m = torch.nn.BatchNorm1d(4).eval()
    m.to("spyre")
    assert all(p.device.type == "spyre" for p in m.parameters())
    assert m.running_mean.device.type == "spyre"
    assert m.to("cpu").running_var.device.type == "cpu"


def test_ops_launch_their_prepared_programs_and_never_compile_again():
    torch.spyre.warmup()  # every kernel entry compiled (or loaded from Numba's cache) now
    x = torch.randn(8, 8).to("spyre")
    (x @ x + 1).softmax(-1).sum().item()           # one program per op, prepared on first use
    before = torch.spyre.counters()
    for n in (3, 17):                              # other shapes: the same programs, patched
        y = torch.randn(n, n).to("spyre")
        (y @ y + 1).softmax(-1).sum().item()
    after = torch.spyre.counters()
    assert (after["compiles"], after["prepares"]) == (before["compiles"], before["prepares"])
    assert after["launches"] - before["launches"] == 2 * 4


def test_save_and_load_through_the_card(tmp_path):
    x = torch.arange(6.0).reshape(2, 3).to("spyre")
    torch.save({"x": x, "row": x[1]}, tmp_path / "t.pt")
    back = torch.load(tmp_path / "t.pt")                       # to the card it came from
    assert back["x"].device.type == "spyre" and back["x"].tolist() == x.tolist()
    assert back["row"].untyped_storage().data_ptr() == back["x"].untyped_storage().data_ptr()
    assert torch.load(tmp_path / "t.pt", map_location="cpu")["row"].tolist() == [3.0, 4.0, 5.0]
    torch.save(torch.arange(3), tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", map_location="spyre").cpu().tolist() == [0, 1, 2]
    s = torch.arange(4, dtype=torch.int32).untyped_storage().to(device="spyre")
    assert s.device.type == "spyre" and torch.UntypedStorage(16, device="spyre").nbytes() == 16


def test_a_forked_child_cannot_use_the_parents_card():
    r = run_python("import os, torch\n"
                   "torch.ones(1, device='spyre')\n"
                   "pid = os.fork()\n"
                   "if pid == 0:\n"
                   "    try:\n        torch.ones(1, device='spyre')\n"
                   "    except RuntimeError as e:\n        print('child:', torch.spyre._is_in_bad_fork(), e)\n"
                   "    os._exit(0)\n"
                   "os.waitpid(pid, 0)\nprint('parent:', torch.spyre._is_in_bad_fork())")
    assert r.returncode == 0, r.stderr
    assert "child: True spyre: the card was made in the parent process" in r.stdout
    assert "parent: False" in r.stdout


# ---- several cards: $SPYRE_DEVICE_COUNT=2, in one fresh process shared by the tests below -------

TWO_CARDS = r'''
import io, json, numba, torch
from spyre_torch import runtime, smi
from spyre_torch.memory import CARD_SPAN, DEVICE_BASE
out = {"count": torch.spyre.device_count(), "made_by_count": torch.spyre.is_initialized(),
       "allocated_1_before": torch.spyre.memory_allocated(1)}
a, b = torch.randn(6, 8), torch.randn(8, 5)
x0 = a.to("spyre:0")
out["made_0_only"] = [runtime.initialized(0), runtime.initialized(1), runtime.initialized()]
x1, w1 = a.to("spyre:1"), b.to("spyre:1")
out["made_1"] = runtime.initialized(1)
out["devices"] = [str(x0.device), str(x1.device), str(torch.empty(2, device="spyre:1").device)]
out["spans"] = [(x0.data_ptr() - DEVICE_BASE) // CARD_SPAN, (x1.data_ptr() - DEVICE_BASE) // CARD_SPAN]
expected = torch.softmax(a @ b + 1, -1)
r0 = torch.softmax(x0 @ b.to("spyre:0") + 1, -1)
r1 = torch.softmax(x1 @ w1 + 1, -1)
out["results_device"] = str(r1.device)
out["equal_cpu"] = [torch.allclose(r.cpu(), expected, atol=1e-6) for r in (r0, r1)]
torch.spyre.empty_cache()
before = [torch.spyre.memory_allocated(i) for i in (0, 1)]
big = torch.empty(1000, device="spyre:1")   # 4000 bytes: 32 sticks of 128
out["memory_delta"] = [torch.spyre.memory_allocated(i) - before[i] for i in (0, 1)]
out["stats_1"] = (torch.spyre.memory_stats("spyre:1")["allocation.all.current"]
                  - torch.spyre.memory_stats(1)["allocation.all.current"])
del big
torch.spyre.empty_cache()
out["memory_back"] = [torch.spyre.memory_allocated(i) - before[i] for i in (0, 1)]
moved = x0.to("spyre:1")
into = torch.zeros(6, 8, device="spyre:0")
into.copy_(x1 * 2)
out["copies"] = [str(moved.device), torch.equal(moved.cpu(), a), torch.equal(into.cpu(), a * 2)]
try:
    x0 + x1
except RuntimeError as e:
    out["mixed"] = str(e)
try:
    torch.cat([x0, x1])
except RuntimeError as e:
    out["mixed_list"] = str(e)
refused = []
for call in (lambda: torch.spyre.set_device(2), lambda: torch.empty(1, device="spyre:2"),
             lambda: torch.spyre.memory_allocated(2), lambda: a.to("spyre:2")):
    try:
        call()
        refused.append("accepted")
    except RuntimeError as e:
        refused.append(str(e))
out["refused"] = refused
torch.spyre.set_device(1)
out["current"] = [torch.spyre.current_device(), str(torch.empty(1, device="spyre").device),
                  str(a.spyre().device)]
with torch.spyre.device(0):
    out["inside_device_0"] = [torch.spyre.current_device(), str(torch.ones(1, device="spyre").device)]
out["after_device_0"] = torch.spyre.current_device()
s0 = torch.spyre.Stream(device=0)
with torch.spyre.stream(s0):
    out["in_stream_of_0"] = [torch.spyre.current_device(), str(torch.spyre.current_stream().device)]
    y0 = x0 * 3
    done = torch.spyre.Event()
    done.record()
torch.spyre.current_stream(1).wait_event(done)
torch.spyre.synchronize(0)
out["stream"] = [str(torch.spyre.Stream(device=1).device), str(torch.spyre.default_stream(1).device),
                 torch.equal(y0.cpu(), a * 3), torch.spyre.current_device()]
threads = []
for i in (0, 1):
    runtime.runtime(i).default_stream.enqueue(lambda: threads.append(numba.get_num_threads()), compute=False)
    torch.spyre.synchronize(i)
out["threads"] = [threads, numba.config.NUMBA_NUM_THREADS]
out["props"] = [torch.spyre.get_device_properties(i).total_memory for i in (0, 1)]
sorted1 = torch.sort(x1, dim=-1).values                   # the CPU fallback: back to card 1
out["fallback"] = [str(sorted1.device), torch.equal(sorted1.cpu(), torch.sort(a, dim=-1).values)]
buf = io.StringIO()
with smi.monitor(interval=0.05, out=buf):
    (x1 @ w1).sum().item()
out["smi_cards"] = sorted({line.split()[1] for line in buf.getvalue().splitlines()[1:]})
print("RESULT", json.dumps(out))
'''


@pytest.fixture(scope="module")
def two_cards() -> dict:
    import json

    r = run_python(TWO_CARDS, env={"SPYRE_DEVICE_COUNT": "2"}, timeout=300)
    assert r.returncode == 0, r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def test_device_count_is_the_variable_and_asking_makes_no_card(two_cards):
    assert two_cards["count"] == 2 and two_cards["made_by_count"] is False
    assert two_cards["allocated_1_before"] == 0
    assert two_cards["made_0_only"] == [True, False, True]  # each card made by its first tensor
    assert two_cards["made_1"] is True


def test_tensors_live_on_each_card_and_ops_there_equal_the_cpu(two_cards):
    assert two_cards["devices"] == ["spyre:0", "spyre:1", "spyre:1"]
    assert two_cards["spans"] == [0, 1]  # no two cards' device pointers are equal
    assert two_cards["results_device"] == "spyre:1"
    assert two_cards["equal_cpu"] == [True, True]
    assert two_cards["props"] == [4 << 30, 4 << 30]


def test_each_card_counts_its_own_memory(two_cards):
    assert two_cards["memory_delta"] == [0, 4096]
    assert two_cards["stats_1"] == 0  # "spyre:1" and 1 name the same card
    assert two_cards["memory_back"] == [0, 0]


def test_copies_between_cards(two_cards):
    assert two_cards["copies"] == ["spyre:1", True, True]


def test_an_op_on_two_cards_raises_as_torch_does_for_two_cuda_devices(two_cards):
    for key, op in (("mixed", "add.Tensor"), ("mixed_list", "cat")):
        assert two_cards[key].startswith("Expected all tensors to be on the same device, but found at "
                                         "least two devices, spyre:0 and spyre:1!")
        assert op in two_cards[key]


def test_a_card_past_the_last_is_refused_naming_the_count(two_cards):
    for message in two_cards["refused"]:
        assert "invalid device ordinal 2: there are 2 cards" in message and "SPYRE_DEVICE_COUNT=2" in message


def test_the_current_card_streams_and_events_per_card(two_cards):
    assert two_cards["current"] == [1, "spyre:1", "spyre:1"]
    assert two_cards["inside_device_0"] == [0, "spyre:0"] and two_cards["after_device_0"] == 1
    assert two_cards["in_stream_of_0"] == [0, "spyre:0"]  # a stream's context makes its card current
    assert two_cards["stream"] == ["spyre:1", "spyre:1", True, 1]


def test_the_cards_share_the_hosts_cores(two_cards):
    threads, total = two_cards["threads"]
    assert threads == [max(1, total // 2)] * 2


def test_the_cpu_fallback_returns_to_the_ops_card_and_smi_shows_each_card(two_cards):
    assert two_cards["fallback"] == ["spyre:1", True]
    assert two_cards["smi_cards"] == ["0", "1"]


@pytest.mark.parametrize("value", ["0", "two"])
def test_a_bad_device_count_is_refused_with_its_value(value):
    r = run_python("import torch\ntorch.spyre.device_count()", env={"SPYRE_DEVICE_COUNT": value})
    assert r.returncode != 0
    assert f"$SPYRE_DEVICE_COUNT must be a whole number of cards from 1 to 128, got '{value}'" in r.stderr
