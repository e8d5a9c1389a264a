"""Runtime LoRA loads (issue 38, finding 3): only under the allowed roots (--allowed-lora-root,
else the directories holding the --lora-modules adapters), checked on the real path; one
message for every path refused, whatever exists there; no lock held while an adapter's files
are read; host copies capped by --max-cpu-loras."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest

from spyre_serve.server.launch.settings import Settings
from tests.models.hf_checkpoints import granite_config
from tests.models.lora_adapters import write_numpy_adapter
from tests.server.openai.fakes import ScriptedEngine, client_for

CONFIG = granite_config(hidden=64, layers=2, heads=4)


class LoadingEngine(ScriptedEngine):
    """Takes every LoRA update, keeping the paths it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.updates: list = []

    async def lora_update(self, op, name, path):
        self.updates.append((op, name, path))
        return None


@pytest.fixture()
def tree(tmp_path):
    """root/good (an adapter), root/empty, root/file, root/fifo (a FIFO for its config),
    root/out -> outside/adapter (a symlink out of the root), outside/adapter."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    write_numpy_adapter(root / "good", CONFIG)
    write_numpy_adapter(outside / "adapter", CONFIG)
    (root / "empty").mkdir()
    (root / "file").write_text("{}")
    write_numpy_adapter(root / "fifo", CONFIG)
    (root / "fifo" / "adapter_config.json").unlink()
    os.mkfifo(root / "fifo" / "adapter_config.json")
    (root / "out").symlink_to(outside / "adapter")
    return root, outside


def _client(engine, **settings):
    return client_for(engine, enable_lora=True, allow_runtime_lora=True, **settings)


def _load(client, path, name="x"):
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def test_an_adapter_under_the_allowed_root_is_loaded_by_its_real_path(tree):
    root, _ = tree
    engine = LoadingEngine()
    client = _client(engine, allowed_lora_root=(str(root),))
    r = _load(client, root / "empty" / ".." / "good")
    assert r.status_code == 200, r.text
    assert engine.updates == [("load", "x", os.path.realpath(root / "good"))]


def test_every_path_refused_gets_one_message_whatever_is_there(tree, monkeypatch):
    """Relative, '..' out of the root, a symlink out of it, nothing there, a file, a directory
    without the files, a FIFO for a file: one 400, naming none of it, and the engine never asked."""
    root, outside = tree
    monkeypatch.chdir(root)
    engine = LoadingEngine()
    client = _client(engine, allowed_lora_root=(str(root),))
    paths = ["good", root / ".." / "outside" / "adapter", outside / "adapter", root / "out",
             root / "missing", root / "file", root / "empty", root / "fifo", "/etc", "/dev/zero"]
    start = time.monotonic()
    answers = [_load(client, p) for p in paths]
    assert time.monotonic() - start < 10, "a refusal waited on something"
    assert all(r.status_code == 400 for r in answers), [r.text for r in answers]
    errors = [r.json()["error"] for r in answers]
    assert len({e["message"].replace(repr(str(p)), "PATH") for e, p in zip(errors, paths, strict=True)}) == 1, \
        [e["message"] for e in errors]
    assert all(e["param"] == "lora_path" and e["code"] == 400 for e in errors)
    assert engine.updates == []


def test_without_the_flag_the_roots_are_the_start_up_adapters_directories(tree):
    root, outside = tree
    engine = LoadingEngine()
    client = _client(engine, lora_modules={"good": str(root / "good")})
    assert _load(client, root / "fifo").status_code == 400               # a sibling, but not an adapter
    assert _load(client, outside / "adapter").status_code == 400
    write_numpy_adapter(root / "new", CONFIG)
    assert _load(client, root / "new").status_code == 200
    assert engine.updates[-1][2] == os.path.realpath(root / "new")


def test_runtime_loads_need_a_root():
    with pytest.raises(ValueError, match="--allowed-lora-root"):
        Settings(enable_lora=True, allow_runtime_lora=True).with_numerics()


def test_max_cpu_loras_is_vllms_and_at_least_max_loras():
    assert Settings(enable_lora=True).max_cpu_loras is None
    with pytest.raises(ValueError, match="--max-cpu-loras 1 .* --max-loras 2"):
        Settings(enable_lora=True, max_loras=2, max_cpu_loras=1).with_numerics()


def _runner(max_cpu_loras=None):
    from spyre_serve.device import Card
    from spyre_serve.models.lora.arena import LoraArena

    card = Card(64 << 20)
    arena = LoraArena(card, CONFIG, 1, 16, card.new_stream("compute"),
                      **({"max_cpu_loras": max_cpu_loras} if max_cpu_loras else {}))
    return card, SimpleNamespace(lora=arena, config=CONFIG)


def test_no_lock_is_held_while_an_adapters_files_are_read(tree, monkeypatch):
    """A load whose files read slowly (a slow disk, a network mount) holds back no other
    load or unload: they read first, then take the lock to register."""
    import spyre_serve.models as models
    from spyre_serve.server.lora.adapters import apply_update

    root, _ = tree
    card, runner = _runner()
    real_read, release = models.read_adapter, threading.Event()

    def slow_read(path, *args):
        if str(path).endswith("slow"):
            release.wait(30)
        return real_read(path, *args)

    write_numpy_adapter(root / "slow", CONFIG)
    monkeypatch.setattr(models, "read_adapter", slow_read)
    try:
        assert apply_update(runner, "load", "good", str(root / "good")) is None
        slow = threading.Thread(target=apply_update, args=(runner, "load", "slow", str(root / "slow")))
        slow.start()
        time.sleep(0.2)
        done = threading.Event()
        other = threading.Thread(target=lambda: (apply_update(runner, "unload", "good", None), done.set()))
        other.start()
        unloaded = done.wait(5)
        release.set()
        slow.join(30)
        other.join(30)
        assert unloaded, "an unload waited for another adapter's files to be read"
        assert runner.lora.registered() == ["slow"]
    finally:
        release.set()
        runner.lora.free()
        card.close()


def test_forty_loads_hold_at_most_max_cpu_loras_in_memory(tree):
    """The audit's 40 loads of one adapter grew the engine by 170 MB: each name's copy is
    kept only while it is among the --max-cpu-loras used last."""
    from spyre_serve.server.lora.adapters import apply_update

    root, _ = tree
    card, runner = _runner(max_cpu_loras=3)
    try:
        for i in range(40):
            assert apply_update(runner, "load", f"n{i}", str(root / "good")) is None
        assert len(runner.lora.registered()) == 40 and len(runner.lora.adapters) == 3
    finally:
        runner.lora.free()
        card.close()


def test_a_malformed_safetensors_file_is_a_400_naming_the_problem(tree):
    """Issue 38, finding 4: a weights file whose header holds a tensor entry that is not an
    object raised TypeError through the load (a 500 naming it); it is a CheckpointError, a 400."""
    import json
    import struct

    from spyre_serve.server.lora.adapters import apply_update

    root, _ = tree
    header = json.dumps({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": 1}).encode()
    (root / "good" / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    card, runner = _runner()
    try:
        status, message = apply_update(runner, "load", "bad", str(root / "good"))
        assert status == 400 and "its entry is not an object" in message, message
    finally:
        runner.lora.free()
        card.close()


class FailingEngine(ScriptedEngine):
    """The engine process's answer to a load that failed unexpectedly, or (``raises``) the
    in-process engine's exception."""

    def __init__(self, raises: bool) -> None:
        super().__init__()
        self.raises = raises

    async def lora_update(self, op, name, path):
        if self.raises:
            raise TypeError("boom: /secret/path")
        return 500, f"LoRA {op} of {name!r} failed: TypeError: boom: /secret/path"


@pytest.mark.parametrize("raises", [False, True])
def test_an_unexpected_failure_is_a_500_naming_only_the_request_id(tree, raises):
    root, _ = tree
    client = client_for(FailingEngine(raises), raise_server_exceptions=False, enable_lora=True,
                        allow_runtime_lora=True, allowed_lora_root=(str(root),))
    for headers in ({}, {"X-Request-Id": "my-id-1"}):
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "good")},
                        headers=headers)
        assert r.status_code == 500
        message, rid = r.json()["error"]["message"], r.headers["x-request-id"]
        assert message == f"internal error (request id {rid}): the server's log says what failed", message
        assert rid == headers.get("X-Request-Id", rid)
