"""The engine's seam above it: the in-process ``Engine``, the engine process's client and the
tests' scripted engine each satisfy ``EngineClient``, the Protocol ``Serving`` is typed against;
and an object missing one of its members does not."""

from __future__ import annotations

import multiprocessing

from spyre_serve.server.engine.client import EngineProcessClient
from spyre_serve.server.engine.core import Engine
from spyre_serve.server.engine.process import EngineInfo
from spyre_serve.server.engine.seams import EngineClient, _members
from tests.server.fakes import FakeRunner, FakeTokenizer
from tests.server.openai.fakes import ScriptedEngine


def test_the_in_process_engine_is_an_engine_client():
    engine = Engine(FakeRunner(), FakeTokenizer())
    engine.start()
    try:
        assert isinstance(engine, EngineClient)
    finally:
        engine.shutdown()


def test_the_engine_process_client_is_an_engine_client():
    api, host = multiprocessing.Pipe(duplex=True)
    client = EngineProcessClient(api, None, EngineInfo("m", "/m", None, "float32", 64, 8, 16, 100, (0,), "fp32"))
    try:
        assert isinstance(client, EngineClient)
    finally:
        host.close()


def test_the_scripted_engine_of_the_api_tests_is_an_engine_client():
    assert isinstance(ScriptedEngine(), EngineClient)


def test_an_engine_missing_a_member_is_not_one():
    engine = ScriptedEngine()
    del engine.eos_token_ids
    assert not isinstance(engine, EngineClient)
    assert {"add_request", "abort", "check_request", "lora_update", "shutdown", "max_model_len",
            "eos_token_ids"} <= set(_members(EngineClient))
