"""The engine process's side of the pipe (``EngineHost``, ``Outbox``) against a scripted engine, and
the API's side (``EngineProcessClient``) against a scripted host, over real pipes in one process: what
crosses, in how many messages, and who answers a request when an API process leaves or the
engine dies. The real processes: tests/server/engine/test_e2e_process.py."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time

from spyre_serve.models.step.interface import SamplingParams
from spyre_serve.server.engine.client import EngineProcessClient
from spyre_serve.server.engine.outputs import SeqUpdate
from spyre_serve.server.engine.process import EngineCounts, EngineHost, EngineInfo
from spyre_serve.server.sched.sequence import GenerationParams

PARAMS = [GenerationParams(SamplingParams(), max_tokens=4)]


class ScriptedEngine:
    def __init__(self) -> None:
        self.num_running_requests = self.num_waiting_requests = self.num_waiting_sequences = 0
        self.alive, self.error = True, None
        self.on_flush = self.on_death = None
        self.added: dict = {}
        self.aborted: list[str] = []
        self.stopped = None

    def add_request(self, rid, ids, params, on_update):
        self.added[rid] = (ids, params, on_update)

    def abort(self, rid):
        self.aborted.append(rid)

    def shutdown(self, timeout):
        self.stopped = timeout


class NoMetrics:
    def render(self):
        return b"# engine\n", "text/plain"


def wait_for(cond, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def host_with(n: int):
    pipes = [multiprocessing.Pipe(duplex=True) for _ in range(n)]
    engine = ScriptedEngine()
    host = EngineHost(engine, NoMetrics(), [theirs for _, theirs in pipes])
    code: list[int] = []
    thread = threading.Thread(target=lambda: code.append(host.serve()), daemon=True)
    thread.start()
    return engine, host, [ours for ours, _ in pipes], thread, code


def test_updates_of_one_iteration_cross_as_one_batch_with_the_counts():
    engine, host, (api,), thread, code = host_with(1)
    api.send(("in", [("add", "a", [1, 2], pickle.dumps(PARAMS), 1), ("add", "b", [3], pickle.dumps(PARAMS), 1)]))
    wait_for(lambda: len(engine.added) == 2)
    assert engine.added["a"][0] == [1, 2] and engine.added["a"][1][0].max_tokens == 4
    for rid in ("a", "b"):
        engine.added[rid][2](SeqUpdate(0, "x", [7], []))
    engine.on_flush()                                    # the loop's iteration ends
    kind, updates, counts, replies = api.recv()
    assert kind == "batch" and [rid for rid, _ in updates] == ["a", "b"] and replies == []
    assert counts == EngineCounts(0, 0, 0, (2, 2), True)
    api.send(("shutdown", 3.0))
    thread.join(5)
    assert code == [0] and engine.stopped == 3.0
    assert api.recv()[0] == "batch" and api.recv() == ("closed",)


def test_an_api_process_that_leaves_takes_its_running_requests_and_the_engine_stays():
    engine, host, (one, two), thread, code = host_with(2)
    one.send(("in", [("add", "a", [1], pickle.dumps(PARAMS), 1)]))
    two.send(("in", [("add", "b", [1], pickle.dumps(PARAMS), 1), ("add", "c", [1], pickle.dumps(PARAMS), 1)]))
    wait_for(lambda: len(engine.added) == 3)
    engine.added["c"][2](SeqUpdate(0, "", [5], [], "length"))   # c finished: nobody owns it
    two.close()                                                 # that API process is gone
    wait_for(lambda: engine.aborted == ["b"])
    assert engine.stopped is None and thread.is_alive() and set(host.owners) == {"a"}
    one.send(("shutdown", 1.0))
    thread.join(5)
    assert code == [0] and engine.stopped == 1.0


def test_a_dead_engine_sends_its_last_updates_then_why():
    engine, host, (api,), thread, code = host_with(1)
    engine.error = RuntimeError("kernel fault")
    engine.on_death(engine.error)
    thread.join(5)
    assert code == [1]
    assert api.recv()[0] == "batch" and api.recv() == ("dead", "RuntimeError: kernel fault")


def test_the_client_counts_what_it_sent_as_waiting_until_the_engine_says_it_took_it():
    api, host = multiprocessing.Pipe(duplex=True)
    info = EngineInfo("m", "/m", None, "float32", 64, 8, 16, 100, (0,), "fp32")
    client = EngineProcessClient(api, None, info)
    got: list[SeqUpdate] = []
    client.add_request("r", [1, 2], PARAMS * 2, got.append)
    assert client.num_waiting_sequences == 2 and client.num_requests == 1
    kind, items = host.recv()
    assert kind == "in" and items[0][:3] == ("add", "r", [1, 2]) and items[0][4] == 2
    host.send(("batch", [("r", SeqUpdate(0, "a", [3], [], "length"))], EngineCounts(1, 0, 0, (1, 2)), []))
    wait_for(lambda: len(got) == 1)
    assert client.num_waiting_sequences == 0 and client.num_running_requests == 1 and client.num_requests == 1
    deaths: list[BaseException] = []
    client.on_death = deaths.append
    host.close()                                     # the engine process is gone
    wait_for(lambda: deaths)
    assert got[-1].index == 1 and got[-1].finish_reason == "error"   # the choice still open fails
    assert not client.alive and client.num_requests == 0
