"""Structured output, tool calls and logit_bias on the real stack (granite-tiny, random weights:
the grammar's mask alone makes the output valid), through the official openai client."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from spyre_serve.server.openai.generation.response_bodies import ChatCompletionResponse
from tests.reliability.servers import NORMAL, beside, running_server
from tests.server.servers import PROMPT

TEMPLATE = Path(__file__).resolve().parents[3] / "examples" / "tool_chat_template_granite.jinja"

# nested objects, arrays, enums, required fields; bounded, so random weights finish it
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    with running_server(max_model_len=1024, num_kv_blocks=256, chat_template=str(TEMPLATE)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def fmt(schema=SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_16_concurrent_schema_requests_beside_free_text_all_validate(server):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        structured = []
        for i in range(16):
            if i % 3 == 0:
                structured.append(aclient.chat.completions.create(
                    model=None, messages=[{"role": "user", "content": f"Person {i}"}], response_format=fmt(),
                    max_tokens=400, temperature=1.0, seed=i))
            else:
                extra = {"guided_json": SCHEMA} if i % 3 == 1 else {"response_format": fmt()}
                structured.append(aclient.completions.create(
                    model=None, prompt=f"{PROMPT} {i}", max_tokens=400, temperature=1.0, seed=i, extra_body=extra))
        free = [aclient.completions.create(model=None, prompt=f"{PROMPT} {i}", max_tokens=24, temperature=1.0,
                                           seed=100 + i) for i in range(8)]
        out = await asyncio.gather(*structured, *free)
        await aclient.close()
        return out[:16], out[16:]

    structured, free = asyncio.run(run())
    for r in structured:
        choice = r.choices[0]
        text = choice.message.content if hasattr(choice, "message") else choice.text
        assert choice.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({(r.choices[0].message.content if hasattr(r.choices[0], "message") else r.choices[0].text)
                for r in structured}) > 8                      # sampled, not one answer
    for r in free:
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 24


def test_json_object_gives_an_object_and_a_stream_gives_the_same_text(client):
    kw = dict(model=None, messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=300,
              temperature=0.7, seed=5)
    r = client.chat.completions.create(**kw)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_regex_choice_and_structured_outputs_on_completions(client):
    for extra, check in [
        ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"structured_outputs": {"regex": "(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
        ({"guided_choice": ["red", "green", "dark blue"]}, lambda t: t in ("red", "green", "dark blue")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ]:
        for seed in range(3):
            r = client.completions.create(model=None, prompt=PROMPT, max_tokens=30, temperature=1.0, seed=seed,
                                          extra_body=extra)
            assert check(r.choices[0].text) and r.choices[0].finish_reason == "stop", (extra, r.choices[0])


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"response_format": fmt({"type": "object", "properties": {"a": {"type": "nonsense"}}})},
     "response_format.json_schema.schema", "not a valid JSON schema"),
    ({"guided_json": {"type": "object", "required": "a"}}, "guided_json", "not a valid JSON schema"),
    ({"guided_regex": "[a-"}, "guided_regex", "invalid"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one kind of structured output"),
    ({"logit_bias": {"999999": 5}}, "logit_bias", "outside the vocabulary"),
])
def test_an_invalid_grammar_is_a_400_naming_it(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=None, prompt=PROMPT, max_tokens=4, extra_body=extra)
    err = info.value.body
    assert err["param"] == param and words in err["message"], err


def test_logit_bias_plus_100_makes_greedy_pick_the_token(client, server):
    tokenizer = server.built.model.tokenizer
    base = client.completions.create(model=None, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    greedy = base.choices[0].text
    target = next(t for t in range(300, 400) if tokenizer.decode([t]) != greedy and tokenizer.decode([t]).strip())
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=1, temperature=0,
                                  logit_bias={str(target): 100})
    assert r.choices[0].text == tokenizer.decode([target])
    ids = tokenizer.encode(greedy, add_special_tokens=False)
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=1, temperature=0,
                                  logit_bias={str(ids[0]): -100})
    assert r.choices[0].text != greedy


def check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_tool_choice_named_and_required_give_parseable_calls(client):
    for seed in range(3):
        r = client.chat.completions.create(model=None, messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=seed,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        msg = r.choices[0].message
        check_calls(msg.tool_calls, {"get_weather"})
        assert r.choices[0].finish_reason == "tool_calls" and not msg.content
        r = client.chat.completions.create(model=None, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, seed=seed)
        check_calls(r.choices[0].message.tool_calls, set(PARAMS))
        assert r.choices[0].finish_reason == "tool_calls"
        ChatCompletionResponse.model_validate(r.model_dump(exclude_unset=True))  # the declared shape


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_calls_add_up_to_the_same_calls(client, choice):
    kw = dict(model=None, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=300, seed=11)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
            if d.id:
                assert call["id"] is None and d.type == "function" and d.function.name
                call["id"], call["name"] = d.id, d.function.name
            call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_tools_and_tool_messages_reach_the_template_and_auto_parses_granite_calls(client, server):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 degrees"},
    ]
    r = client.chat.completions.create(model=None, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 100     # the tools and the call are in it
    msg = r.choices[0].message
    assert msg.content and not msg.tool_calls                          # random weights: text, as is
    # "none" never parses; a required call on a tool that does not exist is refused
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=None, messages=MESSAGES, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice"


def test_a_normal_stream_beside_structured_and_refused_requests_gives_its_solo_text(server):
    solo = httpx.post(server.url + "/v1/completions", json=NORMAL, timeout=600).json()["choices"][0]["text"]

    async def structured(client):
        sent = [client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "seed": i,
                                                     "guided_json": SCHEMA}) for i in range(4)]
        sent += [client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4,
                                                      "guided_regex": "(unclosed"})]
        return await asyncio.gather(*sent)

    text, responses = beside(server, structured)
    assert text == solo
    assert [r.status_code for r in responses] == [200] * 4 + [400]


def test_each_choice_of_n_follows_the_grammar_on_its_own(client):
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=400, temperature=1.0, seed=3, n=3,
                                  extra_body={"guided_json": SCHEMA})
    texts = [c.text for c in r.choices]
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len(set(texts)) == 3


def test_structured_requests_survive_preemption():
    """A KV cache too small for all of them at once: sequences are preempted and recomputed, and
    their matchers (which follow the known tokens, not the cache) still give valid JSON."""
    with running_server(max_model_len=512, num_kv_blocks=40) as s:
        async def run():
            c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=600)
            out = await asyncio.gather(*[c.completions.create(
                model=None, prompt=f"{PROMPT} {i}", max_tokens=300, temperature=1.0, seed=i,
                extra_body={"guided_json": SCHEMA}) for i in range(12)])
            await c.close()
            return out

        out = asyncio.run(run())
        preemptions = s.built.engine.scheduler.num_preemptions
    for r in out:
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    assert preemptions > 0


def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in range(3):
        r = client.chat.completions.create(model=None, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=300, seed=seed)
        check_calls(r.choices[0].message.tool_calls, set(PARAMS))
        assert len(r.choices[0].message.tool_calls) == 1


def test_with_structured_output_wait_grammar_sequences_get_a_token_every_step():
    with running_server(max_model_len=1024, num_kv_blocks=256, structured_output_wait=True) as s:
        engine = s.built.engine

        async def run():
            c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=600)
            out = await asyncio.gather(*[c.completions.create(
                model=None, prompt=f"{PROMPT} {i}", max_tokens=48, temperature=1.0, seed=i,
                extra_body={"ignore_eos": True, **({"guided_regex": "[a-z ]{1000}"} if i % 2 else {})})
                for i in range(4)])
            await c.close()
            return out

        steps = engine.stats.steps
        out = asyncio.run(run())
        steps = engine.stats.steps - steps
    assert all(r.usage.completion_tokens == 48 for r in out)
    assert all(re.fullmatch("[a-z ]+", r.choices[0].text) for r in out[1::2])
    assert steps < 48 + 12          # not every other step: 48 tokens in about 48 steps (+ prefill)


@pytest.mark.parametrize("regex", ["a{2000000}", "(a{1000}){1000}"])
def test_a_grammar_llguidance_gives_up_on_midway_is_a_400_and_leaves_nothing(server, regex):
    """Regexes whose lexer llguidance builds as tokens come and gives up on ("too many expressions
    constructed") after the first token or a later one (issue 38: they ended with "stop" and the
    text so far, which does not match). The request gets a 400 saying why (a stream, an error
    event); its blocks are freed and the server serves the next one."""
    body = {"prompt": PROMPT, "max_tokens": 8, "guided_regex": regex}
    with httpx.Client(base_url=server.url, timeout=600) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        assert "grammar could not go on after" in r.json()["error"]["message"], r.text
        events = [line[6:] for line in c.post("/v1/completions", json={**body, "stream": True}).text.splitlines()
                  if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "could not go on" in json.loads(events[-2])["error"]["message"]
        ok = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "guided_regex": "a{4}"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "aaaa", ok.text
    engine = server.built.engine
    deadline = time.monotonic() + 30
    while engine.num_requests or engine.blocks.num_used:
        assert time.monotonic() < deadline, (engine.num_requests, engine.blocks.num_used)
        time.sleep(0.02)
