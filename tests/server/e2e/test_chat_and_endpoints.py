"""Chat completions, the other endpoints, and the official openai client, on the real stack."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import openai
import pytest
from tokenizers.processors import TemplateProcessing

from spyre_serve.models.checkpoints.profiles import ASSETS
from spyre_serve.models.checkpoints.tokenizer import load_tokenizer
from spyre_serve.server.launch.settings import Settings
from spyre_serve.server.openai.app import create_app
from tests.server.servers import PROMPT, ServerThread, sse_events

MESSAGES = [{"role": "user", "content": "Say hello."}]


def test_chat_returns_an_assistant_message_and_counts_tokens(client):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_completion_tokens": 4,
                                                  "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    prompt = client.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 4, "total_tokens": prompt + 4,
                             "spyre": body["usage"]["spyre"]}     # its steps on a real card


def test_chat_prompt_is_the_tokenizers_chat_template(client):
    ids = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    text = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.startswith("<|start_of_role|>system<|end_of_role|>")
    assert "<|start_of_role|>user<|end_of_role|>Say hello.<|end_of_text|>" in text
    assert text.endswith("<|start_of_role|>assistant<|end_of_role|>")


def test_chat_stream_sends_the_role_first_then_content_then_done(client):
    body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert events[-2]["usage"]["completion_tokens"] == 3
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2])
    full = client.post("/v1/chat/completions", json={**body, "stream": False, "stream_options": None}).json()
    assert content == full["choices"][0]["message"]["content"]
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_without_include_usage_ends_with_the_finish_then_done(client):
    body = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    last = events[-2]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("length", None)


def test_chat_logprobs_give_top_logprobs_per_token(client):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "temperature": 0,
                                                  "ignore_eos": True, "logprobs": True, "top_logprobs": 3})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    for entry in content:
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["bytes"] == list(entry["token"].encode())


def test_models_lists_the_served_model_with_its_context_length(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert body["data"][0]["id"] == "granite-tiny"
    assert body["data"][0]["max_model_len"] == 1024


def test_health_is_ok_while_the_engine_runs(client):
    assert client.get("/health").status_code == 200


def test_tokenize_and_detokenize_round_trip(client):
    body = client.post("/tokenize", json={"prompt": PROMPT}).json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": PROMPT}


def test_metrics_use_vllms_names_and_the_cards_counters(client, greedy):
    text = client.get("/metrics").text
    for name in [
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
        "spyre_compiles_after_warmup", "spyre_launches_total", "spyre_device_busy_fraction",
        "spyre_device_memory_used_bytes",
    ]:
        assert name in text, name
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    # the shared server prepares its programs lazily (no warm-up, for the suite's time): the
    # first launch of a bucket may compile, when nothing in this process compiled the step
    # before; a request whose buckets are prepared compiles nothing
    key = 'spyre_compiles_after_warmup{model_name="granite-tiny"}'
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                             "ignore_eos": True, "logprobs": 1})
    assert r.status_code == 200
    again = client.get("/metrics").text
    assert f"{key} {values[key]}" in again
    assert values['vllm:generation_tokens_total{model_name="granite-tiny"}'] >= 12
    assert values['vllm:request_success_total{finished_reason="length",model_name="granite-tiny"}'] >= 1
    assert 0 < values['spyre_device_busy_fraction{model_name="granite-tiny"}'] <= 1
    from spyre_serve.device.isa import current

    KERNEL_ISA = current()
    isa = [k for k in values if k.startswith("spyre_kernel_isa{")]
    assert isa == [f'spyre_kernel_isa{{host_isa="{KERNEL_ISA.host_level}",isa="{KERNEL_ISA.level}",'
                   f'model_name="granite-tiny"}}'] and values[isa[0]] == 1


@pytest.fixture(scope="module")
def oai(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)


def test_the_openai_client_completes(oai, greedy):
    out = oai.completions.create(model="granite-tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert greedy["choices"][0]["text"].startswith(out.choices[0].text)
    assert out.usage.completion_tokens == 3


def test_the_openai_client_chats(oai):
    out = oai.chat.completions.create(model="granite-tiny", messages=MESSAGES, max_completion_tokens=3,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    assert out.choices[0].finish_reason == "length"


def test_the_openai_client_streams_completions_and_chat(oai, greedy):
    stream = oai.completions.create(model="granite-tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                    stream=True, extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert greedy["choices"][0]["text"].startswith(text) and text
    chat = oai.chat.completions.create(model="granite-tiny", messages=MESSAGES, max_tokens=3, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(chat)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 3


@pytest.fixture(scope="module")
def bos_client(real_server):
    """An app over the same engine whose tokenizer puts a BOS (id 0) before every encoded
    text, as a Llama tokenizer does (granite-tiny's adds nothing)."""
    built = real_server.built
    tokenizer = load_tokenizer(ASSETS)  # its own backend: the served tokenizer is left alone
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|end_of_text|> $A", special_tokens=[("<|end_of_text|>", 0)])
    model = SimpleNamespace(name="granite-tiny", path=built.model.path, config=built.model.config,
                            tokenizer=tokenizer)
    with ServerThread(create_app(built.engine, model, Settings())) as server:
        with httpx.Client(base_url=server.url, timeout=600) as c:
            yield c


def test_the_served_tokenizer_adds_no_bos_so_a_prompts_tokens_are_its_texts(client):
    with_special = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert with_special == client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()[
        "tokens"]


def test_a_completion_prompt_starts_with_the_bos_as_in_vllm_and_tokenize_counts_it(bos_client, client):
    plain = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    tokens = bos_client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert tokens == [0, *plain]
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = bos_client.post("/v1/completions", json={"prompt": PROMPT, **greedy}).json()
    assert r["usage"]["prompt_tokens"] == len(tokens)
    with_bos = client.post("/v1/completions", json={"prompt": tokens, **greedy}).json()["choices"][0]["text"]
    without = client.post("/v1/completions", json={"prompt": plain, **greedy}).json()["choices"][0]["text"]
    assert r["choices"][0]["text"] == with_bos != without  # the engine read the BOS
    r = bos_client.post("/v1/completions", json={"prompt": PROMPT, "add_special_tokens": False, **greedy}).json()
    assert r["usage"]["prompt_tokens"] == len(plain) and r["choices"][0]["text"] == without


def test_a_chat_gets_no_second_bos_and_tokenize_counts_what_it_sends(bos_client):
    tokens = bos_client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    r = bos_client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).json()
    assert r["usage"]["prompt_tokens"] == len(tokens) and tokens[0] != 0  # the template's text, as rendered
