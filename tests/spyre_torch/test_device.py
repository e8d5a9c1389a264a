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
    with pytest.raises(RuntimeError, match="one card"):
        torch.spyre.set_device(1)
    with pytest.raises(RuntimeError, match="spyre:1"):
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
