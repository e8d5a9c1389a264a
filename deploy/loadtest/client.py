"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

A chunk "carries a token" when its first choice has a ``text`` (completions)
or a ``delta.content`` (chat) string that is non-empty, or empty without a
``finish_reason`` (a token whose text the server holds back, such as half a
UTF-8 character). A role-only chat delta and an empty closing chunk carry
none. Token counts come from the final usage chunk
(``stream_options.include_usage``) when the server sends one, else from the
chunks counted. A non-200 status, an ``{"error": ...}`` chunk, a stream that
ends without ``[DONE]`` or a time-out makes the request fail.
"""

from __future__ import annotations

import json
import time

import httpx

from .datasets import Prompt
from .stats import RequestResult


def request_body(p: Prompt, model: str, chat: bool, temperature: float,
                 ignore_eos: bool) -> dict:
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                  "temperature": temperature}
    if chat:
        body["messages"] = p.messages
        body["max_completion_tokens"] = p.output_len
    else:
        body["prompt"] = p.prompt
        body["max_tokens"] = p.output_len
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _token_text(chunk: dict, chat: bool) -> str | None:
    """The text of a chunk's token, or None when the chunk carries no token."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    if not isinstance(text, str):
        return None
    if text == "" and choice.get("finish_reason") is not None:
        return None
    return text


async def send(client: httpx.AsyncClient, url: str, body: dict, chat: bool,
               prompt_len: int | None, t0: float, timeout: float) -> RequestResult:
    """Send one request; ``t0`` is the run's start on the perf_counter clock."""
    st = time.perf_counter()
    r = RequestResult(success=False, start=st - t0)
    chunks = 0
    last = st
    usage = None
    done = False
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                r.error = f"HTTP {resp.status_code}: {text[:300]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    r.error = f"error chunk: {err.get('message', err) if isinstance(err, dict) else err}"
                    return r
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("finish_reason"):
                    r.finish_reason = choices[0]["finish_reason"]
                if _token_text(chunk, chat) is None:
                    continue
                if chunks == 0:
                    r.ttft = now - st
                else:
                    r.itl.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"
        return r
    if not done:
        r.error = "the stream ended without [DONE]"
        return r
    if chunks == 0:
        r.error = "the stream carried no token"
        return r
    r.latency = last - st
    r.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    r.prompt_tokens = int(usage["prompt_tokens"]) if usage else (prompt_len or 0)
    r.success = True
    return r
