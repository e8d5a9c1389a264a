"""The request bodies that tools written for vLLM send, sent unmodified to the real server
(granite-tiny), and what each tool reads of the answers, parsed in a few lines as the tool
parses it (the tools themselves are not imported):

- vLLM's benchmark client ``vllm bench serve``, backends ``openai`` and ``openai-chat``
  (vllm-project/vllm vllm/benchmarks/lib/endpoint_request_func.py at 02cfb534,
  vllm/benchmarks/serve.py at 009e6d4a);
- lm-evaluation-harness ``local-completions`` and ``local-chat-completions``
  (EleutherAI/lm-evaluation-harness lm_eval/models/openai_completions.py and
  lm_eval/models/api_models.py at 4e7e0d47, version 0.4.13.dev0);
- the official ``openai`` Python client 3.60.0: the body each call puts on the wire (read off
  the raw response's request) and what the client parses.
"""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import openai
import pytest

from tests.server.servers import PROMPT

MODEL = "granite-tiny"


def post(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse_messages(client, path: str, body: dict) -> list[dict]:
    """The JSON messages of a stream as vllm bench's StreamedResponseHandler splits them: on
    blank lines, SSE comments (":") skipped, "data: " removed, "[DONE]" dropped."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read().decode()
        raw = r.read().decode()
    messages = [m.strip() for m in raw.split("\n\n") if m.strip() and not m.strip().startswith(":")]
    assert messages[-1] == "data: [DONE]", messages[-1]
    return [json.loads(m.removeprefix("data: ")) for m in messages[:-1]]


def tokenize(client, text: str) -> list[int]:
    """lm-eval's tok_encode (add_special_tokens=False), as its RemoteTokenizer.encode asks the
    server (lm_eval/utils.py RemoteTokenizer.encode)."""
    return post(client, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]


# ---------------------------------------------------------------------------------------------
# vllm bench serve (vllm/benchmarks/lib/endpoint_request_func.py at 02cfb534)

def bench_parse(messages: list[dict], content) -> dict:
    """async_request_openai_completions / _chat_completions' parse: a message with choices is a
    token chunk (``content`` reads its text), else its usage gives output_tokens and prompt_len."""
    out = {"text": "", "chunks": 0, "output_tokens": None, "prompt_len": None}
    for data in messages:
        if choices := data.get("choices"):
            out["chunks"] += 1
            out["text"] += content(choices[0]) or ""
        elif usage := data.get("usage"):
            out["output_tokens"] = usage.get("completion_tokens")
            if (pt := usage.get("prompt_tokens")) is not None:
                out["prompt_len"] = pt
    return out


# serve.py main_async: --temperature etc. reach the body through extra_body (none by default: it
# warns that the server decides); the random datasets set ignore_eos
BENCH_EXTRA = [pytest.param({}, id="server-default-temperature"),
               pytest.param({"temperature": 0.0}, id="temperature-0")]


def test_bench_serve_reads_the_model_and_aligns_prompts_with_tokenize(client):
    """serve.py get_first_model_from_server reads data[0].id and .root; _align_prompts_to_server_tokenizer
    posts {model, prompt, add_special_tokens: false} to /tokenize and {model, tokens} to /detokenize."""
    models = client.get("/v1/models")
    assert models.status_code == 200, models.text
    first = models.json()["data"][0]
    assert first["id"] == MODEL and isinstance(first["root"], str) and first["root"]
    tokens = post(client, "/tokenize", {"model": MODEL, "prompt": PROMPT, "add_special_tokens": False})["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    assert post(client, "/detokenize", {"model": MODEL, "tokens": tokens})["prompt"] == PROMPT


@pytest.mark.parametrize("extra_body", BENCH_EXTRA)
@pytest.mark.parametrize("prompt_kind", ["text", "token-ids"])
def test_bench_serve_openai_backend(client, greedy, extra_body, prompt_kind):
    """Backend "openai": async_request_openai_completions' payload, then _update_payload_common
    (ignore_eos, extra_body); a token-id prompt is what the timed_trace dataset sends."""
    ids = tokenize(client, PROMPT)
    payload = {
        "model": MODEL,
        "prompt": PROMPT if prompt_kind == "text" else ids,
        "repetition_penalty": 1.0,
        "max_tokens": 6,
        "logprobs": None,           # RequestFuncInput.logprobs: --logprobs, None unless given
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payload.update({"ignore_eos": True, **extra_body})
    out = bench_parse(sse_messages(client, "/v1/completions", payload), lambda c: c.get("text"))
    assert out["chunks"] >= 1                     # "Never received a valid chunk" otherwise
    assert out["output_tokens"] == 6              # ignore_eos: exactly max_tokens
    assert out["prompt_len"] == len(ids)
    if extra_body.get("temperature") == 0.0:
        assert greedy["choices"][0]["text"].startswith(out["text"]) and out["text"]


@pytest.mark.parametrize("extra_body", BENCH_EXTRA)
def test_bench_serve_openai_chat_backend(client, extra_body):
    """Backend "openai-chat": async_request_openai_chat_completions' payload, the prompt as one
    user message of text parts (_get_chat_messages / _get_chat_content)."""
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "max_completion_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payload.update({"ignore_eos": True, **extra_body})
    messages = sse_messages(client, "/v1/chat/completions", payload)
    out = bench_parse(messages, lambda c: c["delta"].get("content"))
    assert out["chunks"] >= 1 and out["text"]
    assert out["output_tokens"] == 6
    assert out["prompt_len"] > len(tokenize(client, PROMPT))   # the chat template's tokens too


# ---------------------------------------------------------------------------------------------
# lm-evaluation-harness (lm_eval/models/openai_completions.py at 4e7e0d47)

def lm_eval_loglikelihood_payload(prompt) -> dict:
    """LocalCompletionsAPI._create_payload(generate=False), seed the TemplateAPI default 1234."""
    return {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}


def lm_eval_parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """LocalCompletionsAPI.parse_logprobs: the continuation is [ctxlen:-1] of the echoed tokens
    (the last is the one generated token); greedy when each is its position's top logprob."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens, strict=False):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs, strict=False))
        res.append((sum(token_logprobs), is_greedy))
    return res


def encode_pair(client, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """TemplateLM._encode_pair (lm_eval/api/model.py) of a causal model."""
    whole, ctx = tokenize(client, context + continuation), tokenize(client, context)
    return ctx, whole[len(ctx):]


def test_lm_eval_remote_tokenizer_probe_leaves_it_a_working_backend(client):
    """LocalCompletionsAPI(tokenizer_backend="auto") first runs check_remote_tokenizer_support
    (lm_eval/utils.py): GET /tokenizer_info (vLLM's, behind --enable-tokenizer-info-endpoint) must
    give a dict with eos_token and POST /tokenize {prompt, add_special_tokens: false} a tokens list;
    any non-2xx answer makes it fall back to its huggingface tokenizer."""
    info = client.get("/tokenizer_info")
    if info.status_code == 200:
        assert "eos_token" in info.json()
        assert isinstance(tokenize(client, "test"), list)
    else:
        assert info.status_code == 404   # as vLLM without the flag: raise_for_status, the huggingface fallback


@pytest.mark.parametrize("tokenized_requests", [True, False])
def test_lm_eval_loglikelihood_batch_of_a_greedy_and_a_non_greedy_continuation(client, greedy, tokenized_requests):
    """_loglikelihood_tokens with batch_size=2: batch_loglikelihood_requests gives the token lists
    and ctxlens; create_message sends them as token ids (tokenized_requests, the default) or
    decoded to strings (tokenized_requests=False)."""
    greedy_lp = greedy["choices"][0]["logprobs"]
    # the greedy continuation's token ids (each of granite-tiny's greedy tokens is one token of
    # its own); sent as text, one token, as more re-tokenize otherwise (lm-eval's warning:
    # decoding must be lossless)
    n = 3 if tokenized_requests else 1
    greedy_ids = [tokenize(client, t) for t in greedy_lp["tokens"][:n]]
    assert all(len(i) == 1 for i in greedy_ids), greedy_ids
    pairs = [(tokenize(client, PROMPT), [i for [i] in greedy_ids]), encode_pair(client, PROMPT, " purple elephants")]
    inputs, ctxlens = [ctx + cont for ctx, cont in pairs], [len(ctx) for ctx, _ in pairs]
    if not tokenized_requests:
        inputs = [post(client, "/detokenize", {"tokens": i})["prompt"] for i in inputs]
        assert [tokenize(client, text) for text in inputs] == [ctx + cont for ctx, cont in pairs]
    out = post(client, "/v1/completions", lm_eval_loglikelihood_payload(inputs))
    assert len(out["choices"]) == 2
    for choice, ids in zip(sorted(out["choices"], key=lambda c: c["index"]), [c + t for c, t in pairs], strict=True):
        lp = choice["logprobs"]
        # echo: every prompt token (the first without a logprob) and the generated one
        assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["tokens"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert isinstance(value, float) and value <= 0 and top[token] == value and 1 <= len(top) <= 2
    (greedy_sum, greedy_ok), (other_sum, other_ok) = lm_eval_parse_logprobs(out, ctxlens)
    assert greedy_ok and not other_ok
    assert greedy_sum == pytest.approx(sum(greedy_lp["token_logprobs"][:n]), abs=1e-3)
    assert math.isfinite(other_sum) and other_sum < greedy_sum


def test_lm_eval_generate_until_with_token_ids(client, greedy, real_server):
    """generate_until with tokenized_requests (the default) and batch_size=1: the prompt is a list
    of one token list; _create_payload(generate=True) with a task's generation_kwargs
    (until, do_sample popped, temperature, max_gen_toks) and the tokenizer's EOS added to stop
    (handle_stop_sequences); parse_generations reads choices[i].text by index."""
    eos = real_server.built.model.tokenizer.eos_token
    gen_kwargs = {"until": ["Question:", "</s>", "<|im_end|>"], "do_sample": False, "temperature": 0.0,
                  "max_gen_toks": 6}
    gen_kwargs.pop("do_sample")
    payload = {
        "prompt": [tokenize(client, PROMPT)],
        "model": MODEL,
        "max_tokens": gen_kwargs.pop("max_gen_toks"),
        "temperature": gen_kwargs.pop("temperature"),
        "stop": [*gen_kwargs.pop("until"), eos],
        "seed": 1234,
        **gen_kwargs,
    }
    out = post(client, "/v1/completions", payload)
    texts = [None] * len(out["choices"])
    for choice in out["choices"]:
        texts[choice["index"]] = choice["text"]
    assert len(texts) == 1 and texts[0] and greedy["choices"][0]["text"].startswith(texts[0])


def test_lm_eval_local_chat_completions(client):
    """LocalChatCompletion._create_payload: messages as lm-eval's apply_chat_template leaves them
    (no tokenizer: tokenized_requests off), stop[:4] (no EOS without a tokenizer), seed; its
    parse_generations reads choices[i].message.content by index."""
    messages = [{"role": "user", "content": "Question: What is 2 + 2?\nAnswer:"}]
    payload = {"messages": messages, "model": MODEL, "max_tokens": 6, "temperature": 0.0,
               "stop": ["Question:", "</s>", "<|im_end|>", "\n\n", "extra"][:4], "seed": 1234}
    out = post(client, "/v1/chat/completions", payload)
    texts = [None] * len(out["choices"])
    for choice in out["choices"]:
        texts[choice["index"]] = choice["message"]["content"]
    assert len(texts) == 1 and isinstance(texts[0], str)
    assert out["choices"][0]["finish_reason"] in ("stop", "length")


# ---------------------------------------------------------------------------------------------
# the official openai client 3.60.0: what it puts on the wire by default

@pytest.fixture(scope="module")
def oai(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def wire_body(raw) -> dict:
    return json.loads(raw.http_request.content)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_completions_body_is_only_what_was_passed(oai, greedy, stream):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    if stream:
        kwargs.update(stream=True, stream_options={"include_usage": True})
    raw = oai.completions.with_raw_response.create(**kwargs)
    assert raw.status_code == 200
    assert wire_body(raw) == kwargs
    if stream:
        chunks = list(raw.parse())
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens <= 4
    else:
        done = raw.parse()
        text = done.choices[0].text
        assert done.usage.completion_tokens <= 4 and done.choices[0].finish_reason in ("stop", "length")
    assert greedy["choices"][0]["text"].startswith(text) and text


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_chat_body_is_only_what_was_passed(oai, stream):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_completion_tokens=4,
                  temperature=0)
    if stream:
        kwargs.update(stream=True, stream_options={"include_usage": True})
    raw = oai.chat.completions.with_raw_response.create(**kwargs)
    assert raw.status_code == 200
    assert wire_body(raw) == kwargs
    if stream:
        chunks = list(raw.parse())
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens <= 4
    else:
        done = raw.parse()
        text = done.choices[0].message.content
        assert done.choices[0].message.role == "assistant" and done.usage.completion_tokens <= 4
    assert isinstance(text, str)


def test_openai_client_embeddings_send_base64_by_default(pooling_server):
    client = openai.OpenAI(base_url=pooling_server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    texts = ["The quick brown fox", "Then"]
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=texts)
    assert raw.status_code == 200
    assert wire_body(raw) == {"model": MODEL, "input": texts, "encoding_format": "base64"}
    sent = json.loads(raw.http_response.content)["data"]
    assert all(isinstance(d["embedding"], str) for d in sent)
    parsed = raw.parse()   # the client decodes the base64 float32 to lists of floats
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    for d, f, s in zip(parsed.data, floats.data, sent, strict=True):
        assert len(d.embedding) == len(f.embedding) > 0
        assert np.allclose(d.embedding, f.embedding, atol=1e-6)
        assert np.array_equal(np.frombuffer(base64.b64decode(s["embedding"]), np.float32), np.float32(d.embedding))
