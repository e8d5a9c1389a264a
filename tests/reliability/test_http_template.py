"""Template injection and heavy templates, on a real server serving a heavy but legal chat
template (``--chat-template``): a request cannot bring its own template, can only fill the
template's variables, and a render past ``--render-timeout`` is a 400 that freezes nothing:
/health answers and a normal stream beside it gives its solo text."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from spyre_serve.models.checkpoints.profiles import ASSETS
from spyre_serve.models.checkpoints.tokenizer import load_tokenizer
from tests.reliability.servers import beside, running_server

# granite-tiny's own template, after `rounds` x 100,000 empty Jinja loop turns (~5 ms a round)
HEAVY = ("{%- if rounds is defined %}{%- for i in range(rounds) %}{%- for j in range(100000) %}{%- endfor %}"
         "{%- endfor %}{%- endif %}") + load_tokenizer(ASSETS).chat_template
TIMEOUT = 1.0
MESSAGES = [{"role": "user", "content": "Hello there."}]


@pytest.fixture(scope="module")
def server():
    with running_server(chat_template=HEAVY, render_timeout=TIMEOUT) as s:
        yield s


def chat(http, **body):
    return http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                                                   "ignore_eos": True, **body})


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_template_sent_in_chat_template_kwargs_is_a_400(http, path):
    r = http.post(path, json={"messages": MESSAGES,
                              "chat_template_kwargs": {"chat_template": "{{ cycler.__init__.__globals__ }}"}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template_kwargs" and "may not carry a chat_template" in err["message"]


@pytest.mark.parametrize("key", ["tokenize", "messages", "bos_token", "return_dict", "no_such_variable"])
def test_a_kwarg_that_is_not_a_variable_left_to_the_client_is_a_400(http, key):
    r = chat(http, chat_template_kwargs={key: 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs"


def test_a_variable_of_the_template_may_be_set(http):
    plain, light = chat(http), chat(http, chat_template_kwargs={"rounds": 2})
    assert plain.status_code == light.status_code == 200, light.text
    assert light.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def test_a_render_past_the_bound_is_a_400_while_health_and_a_stream_go_on(server, http, solo):
    health_seconds: list[float] = []

    async def heavy_render_while_polling_health(client):
        heavy = asyncio.create_task(client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 4, "chat_template_kwargs": {"rounds": 100_000}}))  # ~500 s
        t0 = time.monotonic()
        while not heavy.done():
            start = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            health_seconds.append(time.monotonic() - start)
            await asyncio.sleep(0.05)
        return await heavy, time.monotonic() - t0

    text, (r, seconds) = beside(server, heavy_render_while_polling_health)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": f"rendering the chat template for these messages took longer than {TIMEOUT:g} s (--render-timeout)",
        "type": "BadRequestError", "param": "messages", "code": 400}
    assert TIMEOUT <= seconds < TIMEOUT + 5
    assert len(health_seconds) >= 5 and max(health_seconds) < 0.5, health_seconds
    assert text == solo
    for t in threading.enumerate():  # the render was interrupted, not left spinning
        if t.name == "spyre-offload":
            t.join(5)
            assert not t.is_alive()
    assert http.get("/health").status_code == 200
