"""serving.py: the checks every endpoint makes before it submits, and reading a body."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from spyre_serve.models import SamplingParams
from spyre_serve.server.engine.core import EngineUnavailable, RequestRejected
from spyre_serve.server.launch.settings import Settings
from spyre_serve.server.openai.errors import APIError, install_error_handlers
from spyre_serve.server.openai.generation.protocol import DetokenizeRequest
from spyre_serve.server.openai.serving import Serving, serving_of
from spyre_serve.server.sched.sequence import GenerationParams
from tests.server.openai.fakes import (
    VOCAB,
    CharTokenizer,
    ScriptedEngine,
    client_for,
    fake_model,
)

PARAMS = [GenerationParams(SamplingParams(), max_tokens=5)]


def serving(engine=None, **settings) -> Serving:
    return Serving.for_model(engine or ScriptedEngine(max_model_len=10), fake_model("tiny"), Settings(**settings))


def refused(check, *args) -> APIError:
    with pytest.raises(APIError) as info:
        check(*args)
    return info.value


def test_for_model_takes_the_name_path_vocabulary_and_tokenizer_of_the_model():
    s = serving()
    assert (s.model_name, s.model_root, s.vocab_size) == ("tiny", "/models/tiny", VOCAB)
    assert isinstance(s.tokenizer, CharTokenizer) and s.texts(1) == " "


def test_a_served_model_name_replaces_the_models():
    assert serving(served_model_name="granite").model_name == "granite"


def test_another_model_name_is_a_404_naming_both():
    err = refused(serving().check_model, "gpt-17")
    assert (err.status, err.param) == (404, "model")
    assert err.message == "The model `gpt-17` does not exist. This server serves `tiny`."


def test_the_served_name_or_none_passes():
    serving().check_model("tiny")
    serving().check_model(None)


def test_a_token_outside_the_vocabulary_is_a_400_with_the_range():
    err = refused(serving().check_tokens, [1, VOCAB, -1], "prompt")
    assert (err.status, err.param) == (400, "prompt")
    assert err.message == f"token id {VOCAB} is outside the vocabulary (0..{VOCAB - 1})"


def test_max_tokens_is_the_requested_or_what_the_longest_prompt_leaves():
    s = serving()  # max_model_len 10
    assert s.max_tokens(3, [[1] * 9]) == 3
    assert s.max_tokens(None, [[1] * 4, [1] * 6]) == 4
    assert s.max_tokens(None, [[1] * 12]) == 0


class Rejecting(ScriptedEngine):
    def __init__(self, param: str) -> None:
        super().__init__()
        self.param = param

    def check_request(self, num_prompt_tokens: int, max_tokens: int, params=None, prompt_ids=None) -> None:
        raise RequestRejected(f"{num_prompt_tokens} tokens do not fit", self.param)


def test_a_request_that_can_never_fit_is_a_400_with_the_engines_words():
    err = refused(serving(Rejecting("max_tokens")).check_fits, [1, 2], PARAMS)
    assert (err.status, err.param, err.message) == (400, "max_tokens", "2 tokens do not fit")


def test_check_fits_renames_the_engines_fields_to_the_requests():
    renames = {"prompt": "messages", "max_tokens": "max_completion_tokens"}
    assert refused(serving(Rejecting("prompt")).check_fits, [1], PARAMS, renames).param == "messages"
    assert refused(serving(Rejecting("max_tokens")).check_fits, [1], PARAMS, renames).param == \
        "max_completion_tokens"


def test_a_stopped_engine_is_a_503_with_retry_after():
    engine = ScriptedEngine()
    engine.alive = False
    err = refused(serving(engine).check_admission, 1)
    assert (err.status, err.message, err.retry_after) == (503, "the engine is not running", 1)


def test_a_draining_engine_is_a_503_with_retry_after():
    engine = ScriptedEngine()
    engine.accepting = False
    err = refused(serving(engine).check_admission, 1)
    assert (err.status, err.retry_after) == (503, 1) and "shutting down" in err.message


def test_a_full_waiting_queue_is_a_503_counting_sequences():
    engine = ScriptedEngine()
    engine.num_waiting_sequences = 5
    err = refused(serving(engine, max_waiting=8).check_admission, 4)
    assert err.message == ("the waiting queue is full: 5 sequences waiting, this request adds 4, the limit is 8 "
                           "(--max-waiting)")
    serving(engine, max_waiting=8).check_admission(3)


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    app.state.serving = serving(max_body_bytes=40)

    @app.post("/read")
    async def read(request: Request):
        return {"tokens": (await serving_of(request).read(request, DetokenizeRequest)).tokens}

    return TestClient(app)


def test_read_gives_the_validated_body(client):
    assert client.post("/read", json={"model": "tiny", "tokens": [1]}).json() == {"tokens": [1]}


def test_read_holds_the_body_to_the_settings_limit(client):
    assert client.post("/read", json={"tokens": [1] * 40}).status_code == 413


def test_read_refuses_a_body_naming_another_model(client):
    r = client.post("/read", json={"model": "gpt-17", "tokens": [1]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


class RefusingSecond(ScriptedEngine):
    """Takes the first prompt of a request, then refuses with ``error``."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error_to_raise = error

    def add_request(self, request_id, ids, params, on_update) -> None:
        if request_id.endswith("-1"):
            raise self.error_to_raise
        self.added.append((request_id, ids, params))


@pytest.mark.parametrize(("error", "status", "words"), [
    (RequestRejected("top_k must be an integer in 0..2147483647", "top_k"), 400, "top_k must be an integer"),
    (EngineUnavailable("the engine is not running: OverflowError: boom"), 503, "the engine is not running"),
])
def test_a_prompt_the_engine_refuses_takes_back_the_ones_added_before_it(error, status, words):
    engine = RefusingSecond(error)
    r = client_for(engine).post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
    assert r.status_code == status and r.json()["error"]["message"].startswith(words)
    assert "OverflowError" not in r.text
    assert [rid for rid, _, _ in engine.added] == [a for a in engine.aborted] and len(engine.aborted) == 1
