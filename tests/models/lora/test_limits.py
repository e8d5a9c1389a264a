"""What reading an adapter may cost (issue 38, finding 3): its files are regular files under
size caps, opened without blocking (a FIFO or a device is refused, not waited on or read
forever), and the arena holds at most ``max_cpu_loras`` adapters in host memory (vLLM's
--max-cpu-loras), least recently used dropped first and read again from their directory when a
request needs one."""

from __future__ import annotations

import json
import os
import shutil
import threading

import numpy as np
import pytest

from spyre_serve.device import Card
from spyre_serve.models.lora.adapter import CONFIG_FILE, MAX_CONFIG_BYTES, WEIGHTS_FILE, LoraError, read_adapter
from spyre_serve.models.lora.arena import LoraArena
from tests.models.hf_checkpoints import granite_config
from tests.models.lora_adapters import write_numpy_adapter

CONFIG = granite_config(hidden=64, layers=2, heads=4)


@pytest.fixture()
def adapter(tmp_path):
    return write_numpy_adapter(tmp_path / "a", CONFIG)


def _read_in_a_thread(path, seconds: float = 5.0):
    """read_adapter(path) in a thread: (the exception it raised or None, whether it returned in time)."""
    out: dict = {}

    def run():
        try:
            read_adapter(path, CONFIG, 16)
        except Exception as exc:    # noqa: BLE001 (the test looks at it)
            out["error"] = exc

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    reader.join(seconds)
    return out.get("error"), not reader.is_alive()


@pytest.mark.parametrize("name", [CONFIG_FILE, WEIGHTS_FILE])
def test_a_fifo_for_a_file_is_refused_without_waiting_for_a_writer(adapter, name):
    (adapter / name).unlink()
    os.mkfifo(adapter / name)
    error, returned = _read_in_a_thread(adapter)
    if not returned:                                     # release the reader blocked in open()
        os.close(os.open(adapter / name, os.O_WRONLY | os.O_NONBLOCK))
    assert returned, "reading the adapter waited on a FIFO"
    assert isinstance(error, LoraError) and "not a regular file" in str(error)


@pytest.mark.parametrize(("name", "device"), [(CONFIG_FILE, "/dev/null"), (WEIGHTS_FILE, "/dev/zero")])
def test_a_device_for_a_file_is_refused(adapter, name, device):
    (adapter / name).unlink()
    (adapter / name).symlink_to(device)
    with pytest.raises(LoraError, match="not a regular file"):
        read_adapter(adapter, CONFIG, 16)


def test_a_config_over_its_cap_is_refused_unread(adapter):
    cfg = json.loads((adapter / CONFIG_FILE).read_text())
    (adapter / CONFIG_FILE).write_text(json.dumps({**cfg, "notes": "x" * MAX_CONFIG_BYTES}))
    with pytest.raises(LoraError, match=f"over the limit of {MAX_CONFIG_BYTES} bytes"):
        read_adapter(adapter, CONFIG, 16)


def test_weights_larger_than_any_adapter_of_the_model_are_refused_unread(adapter):
    """The cap: an adapter of rank max_rank on every module of every layer, in float32, and a
    header of at most 1 MiB; a file over it is refused before it is mapped."""
    with open(adapter / WEIGHTS_FILE, "r+b") as f:
        f.truncate(1 << 30)                               # sparse: no disk used
    with pytest.raises(LoraError, match="over the limit of .* bytes for an adapter of rank 16"):
        read_adapter(adapter, CONFIG, 16)


def _arena(max_loras=1, max_cpu_loras=2):
    card = Card(64 << 20)
    return card, LoraArena(card, CONFIG, max_loras, 16, card.new_stream("compute"), max_cpu_loras=max_cpu_loras)


def test_the_arena_holds_at_most_max_cpu_loras_in_host_memory_and_reads_the_others_again(tmp_path):
    paths = {f"a{i}": write_numpy_adapter(tmp_path / f"a{i}", CONFIG, r=i + 1, seed=i) for i in range(5)}
    card, arena = _arena()
    try:
        for name, path in paths.items():
            arena.register(name, read_adapter(path, CONFIG, 16))
        assert list(arena.adapters) == ["a3", "a4"]            # the two used last
        assert sorted(arena.registered()) == sorted(paths)     # every name still served
        slot = arena.pin(1, "a0")                               # read again from its directory
        assert slot == 0 and arena.targets_of({1: slot})[1][2] == 1   # its rank: a0's
        assert list(arena.adapters) == ["a4", "a0"]
        got, want = arena.adapters["a0"].weights, read_adapter(paths["a0"], CONFIG, 16).weights
        assert all(np.array_equal(got[k][0], want[k][0]) for k in want)
        arena.unpin(1)
        shutil.rmtree(paths["a1"])                              # gone since: a clear KeyError
        with pytest.raises(KeyError, match="could not be read again"):
            arena.pin(2, "a1")
        assert arena.pinned() == 0
    finally:
        arena.free()
        card.close()


def test_max_cpu_loras_is_at_least_max_loras():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        _arena(max_loras=2, max_cpu_loras=1)
