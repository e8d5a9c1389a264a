"""auth.py: the bearer token check and the dependency that applies it."""

from __future__ import annotations

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from spyre_serve.server.openai.auth import api_key_guard, check_bearer
from spyre_serve.server.openai.errors import APIError, install_error_handlers


def test_without_a_key_any_header_passes():
    check_bearer("", None)
    check_bearer("Basic whatever", None)


def test_the_right_bearer_token_passes_whatever_the_schemes_case():
    check_bearer("Bearer sesame", "sesame")
    check_bearer("bearer sesame ", "sesame")


@pytest.mark.parametrize("header", ["", "Bearer wrong", "Basic sesame", "sesame", "Bearer "])
def test_a_missing_or_wrong_token_is_a_401(header):
    with pytest.raises(APIError) as info:
        check_bearer(header, "sesame")
    assert info.value.status == 401 and "Authorization: Bearer <key>" in info.value.message


def guarded_client(api_key: str | None) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/guarded", dependencies=[Depends(api_key_guard(api_key))])
    async def guarded():
        return {"ok": True}

    return TestClient(app)


def test_the_guard_refuses_a_request_without_the_key_in_openais_shape():
    r = guarded_client("sesame").get("/guarded")
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"


def test_the_guard_lets_the_key_through():
    r = guarded_client("sesame").get("/guarded", headers={"Authorization": "Bearer sesame"})
    assert r.status_code == 200 and r.json() == {"ok": True}
