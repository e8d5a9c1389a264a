"""server/lora/adapters.py without a model: the flags as parsed, the start-up refusals, the API side's
names, and the prefix cache's root of an adapter's blocks."""

from __future__ import annotations

import pytest

from spyre_serve.server.launch.cli import parse_args
from spyre_serve.server.launch.settings import Settings
from spyre_serve.server.lora.adapters import LoraNames, lora_modules
from spyre_serve.server.sched.block_manager import salt_root


def test_lora_modules_flag_takes_vllm_forms():
    s = parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x", "b=/y",
                    '{"name": "c", "path": "/z"}', "--max-loras", "3", "--max-lora-rank", "8"])
    assert lora_modules(s.lora_modules) == {"a": "/x", "b": "/y", "c": "/z"}
    assert (s.enable_lora, s.max_loras, s.max_lora_rank, s.allow_runtime_lora) == (True, 3, 8, False)


def test_lora_modules_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPYRE_SERVE_LORA_MODULES", "a=/x b=/y")
    s = parse_args(["serve", "--enable-lora"])
    assert lora_modules(s.lora_modules) == {"a": "/x", "b": "/y"}


def test_a_module_that_is_not_name_equals_path_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["serve", "--enable-lora", "--lora-modules", "nopath"])
    assert "is not NAME=PATH" in capsys.readouterr().err


@pytest.mark.parametrize("changes, named", [
    (dict(tensor_parallel_size=2), "--tensor-parallel-size 2"),
    (dict(quantization="int8"), "--quantization int8"),
    (dict(runner="pooling"), "--runner pooling"),
    (dict(model="/m/model.Q8_0.gguf"), "GGUF"),
    (dict(max_loras=0), "--max-loras 0"),
    (dict(allow_runtime_lora=True, api_server_count=2), "--api-server-count 2"),
])
def test_what_lora_cannot_combine_with_is_refused_at_start(changes, named):
    with pytest.raises(ValueError, match="lora|LoRA|max-loras") as e:
        Settings(enable_lora=True, **changes).with_numerics()
    assert named in str(e.value)


def test_lora_flags_need_enable_lora():
    with pytest.raises(ValueError, match="need --enable-lora"):
        Settings(lora_modules={"a": "/x"}).with_numerics()
    with pytest.raises(ValueError, match="need --enable-lora"):
        Settings(allow_runtime_lora=True).with_numerics()


def test_names_resolve_to_an_adapter_and_its_load():
    names = LoraNames.of(Settings(enable_lora=True, lora_modules={"a": "/x"}), "base")
    assert names.resolve("a") == ("a", 1) and names.resolve("base") is None and names.resolve(None) is None
    names.add("a", "/x")                       # loaded again: a new id
    assert names.resolve("a") == ("a", 2)


def test_an_adapters_blocks_have_their_own_root():
    roots = {salt_root(None), salt_root("s"), salt_root(None, ("a", 1)), salt_root(None, ("a", 2)),
             salt_root(None, ("b", 1)), salt_root("s", ("a", 1))}
    assert len(roots) == 6
    assert salt_root(None, ("a", 1)) == salt_root(None, ("a", 1))
