"""A response's id is the server's own (issue 38, finding 6): ``resp_`` and random hex, never
the client's ``X-Request-Id``, so two requests sent with the same header are two stored
responses and ``previous_response_id`` goes on from the one it names; the header still names
the request and comes back on its answer."""

from __future__ import annotations

import re

from tests.server.openai.fakes import CharTokenizer, ScriptedEngine, client_for


def test_two_requests_with_one_request_id_are_two_responses():
    engine = ScriptedEngine()
    client = client_for(engine)
    headers = {"X-Request-Id": "same"}
    first = client.post("/v1/responses", json={"input": "one", "max_output_tokens": 2}, headers=headers)
    second = client.post("/v1/responses", json={"input": "two", "max_output_tokens": 3}, headers=headers)
    assert first.status_code == second.status_code == 200
    assert first.headers["x-request-id"] == second.headers["x-request-id"] == "same"
    ids = [r.json()["id"] for r in (first, second)]
    assert ids[0] != ids[1] and all(re.fullmatch(r"resp_[0-9a-f]{48}", i) for i in ids), ids
    # each kept under its own id, as it was answered
    assert [client.get(f"/v1/responses/{i}").json() for i in ids] == [first.json(), second.json()]
    # and previous_response_id goes on from the first, not from the one sent after it
    client.post("/v1/responses", json={"input": "more", "previous_response_id": ids[0]})
    assert CharTokenizer().decode(engine.added[2][1]) == "user. one assistant. ok user. more assistant."


def test_without_the_header_the_answer_carries_the_response_id_as_its_request_id():
    r = client_for().post("/v1/responses", json={"input": "hi", "max_output_tokens": 1})
    assert r.headers["x-request-id"] == r.json()["id"]


def test_a_malformed_request_id_is_still_refused():
    r = client_for().post("/v1/responses", json={"input": "hi"}, headers={"X-Request-Id": "x" * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
