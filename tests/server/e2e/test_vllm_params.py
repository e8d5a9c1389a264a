"""What vLLM users expect beyond OpenAI's fields (issue 12, section 6), on the real stack:
stop strings kept, special tokens shown, chat echo, prompt logprobs, X-Request-Id, /version
and /ping, --chat-template, generation_config.json defaults, and the metrics vLLM adds.

granite-tiny's greedy continuation of the one-token prompt [7470] is its EOS at once (see
tests/server/engine/test_e2e_min_tokens.py): what a stop token does to the text is seen there.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from spyre_serve.server.launch.settings import Settings
from spyre_serve.server.openai.app import create_app
from tests.server.servers import PROMPT, ServerThread, sse_events

EOS_NEXT = [7470]
EOS_TEXT = "<|end_of_text|>"
GREEDY = {"temperature": 0, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Say hello."}]


def post(client, path: str, status: int = 200, **body) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def streamed_text(client, path: str, **body) -> tuple[str, list]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    chunks = [e for e in events[:-1] if e["choices"]]
    if path.endswith("/chat/completions"):
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks), chunks
    return "".join(c["choices"][0]["text"] for c in chunks), chunks


def a_stop_string(text: str) -> tuple[str, int]:
    """Two characters from the middle of ``text`` that first occur there, and where."""
    for i in range(len(text) // 3, len(text) - 2):
        stop = text[i:i + 2]
        if stop.strip() and text.find(stop) == i:
            return stop, i
    raise AssertionError(f"no stop string in {text!r}")


# ---- top_n_sigma (llama.cpp's sampler) -------------------------------------------------------

def test_top_n_sigma_near_zero_keeps_only_the_top_token_at_any_temperature(client):
    """llama.cpp's top-n-sigma: logits below max - n std are cut, so n -> 0 leaves the top
    token alone; at temperature 2 with a seed the text is the greedy one, which without the
    cut it is not."""
    body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
    greedy = post(client, "/v1/completions", **body, temperature=0)["choices"][0]["text"]
    hot = {**body, "temperature": 2.0, "seed": 5}
    assert post(client, "/v1/completions", **hot, top_n_sigma=1e-6)["choices"][0]["text"] == greedy
    assert post(client, "/v1/completions", **hot)["choices"][0]["text"] != greedy
    assert post(client, "/v1/completions", **hot, top_n_sigma=-1)["choices"][0]["text"] != greedy


# ---- include_stop_str_in_output ------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stop_string_is_kept_with_include_stop_str_in_output_streamed_or_not(client, path):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    body.update(GREEDY, max_tokens=16)
    free = post(client, path, **body)["choices"][0]
    text = free["text"] if "text" in free else free["message"]["content"]
    stop, at = a_stop_string(text)

    def answer(**more):
        choice = post(client, path, **body, stop=[stop], **more)["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
        return choice["text"] if "text" in choice else choice["message"]["content"]

    assert answer() == text[:at]
    assert answer(include_stop_str_in_output=True) == text[:at + len(stop)]
    streamed, _ = streamed_text(client, path, **body, stop=[stop], include_stop_str_in_output=True)
    assert streamed == text[:at + len(stop)]
    streamed, _ = streamed_text(client, path, **body, stop=[stop])
    assert streamed == text[:at]


def test_a_stop_token_id_keeps_its_text_with_include_stop_str_in_output(client):
    ids = post(client, "/tokenize", prompt=PROMPT)["tokens"]
    out = post(client, "/v1/completions", prompt=ids, max_tokens=6, **GREEDY, logprobs=0)["choices"][0]
    tokens = out["logprobs"]["tokens"]
    k = next(i for i in range(2, 6) if tokens[i] not in tokens[:i])
    [stop_id] = post(client, "/tokenize", prompt=tokens[k], add_special_tokens=False)["tokens"]
    body = {"prompt": ids, "max_tokens": 6, **GREEDY, "stop_token_ids": [stop_id]}
    without = post(client, "/v1/completions", **body)["choices"][0]
    kept = post(client, "/v1/completions", **body, include_stop_str_in_output=True)["choices"][0]
    assert (kept["finish_reason"], kept["stop_reason"]) == ("stop", stop_id)
    assert without["text"] == "".join(tokens[:k]) and kept["text"] == "".join(tokens[:k + 1])


# ---- skip_special_tokens ----------------------------------------------------------------------

def test_an_eos_shows_only_with_both_flags_as_in_vllm(client):
    def text(**flags) -> str:
        choice = post(client, "/v1/completions", prompt=EOS_NEXT, max_tokens=4, temperature=0, **flags)["choices"][0]
        assert choice["finish_reason"] == "stop"
        return choice["text"]

    assert text() == "" and text(skip_special_tokens=False) == ""
    assert text(include_stop_str_in_output=True) == ""
    assert text(include_stop_str_in_output=True, skip_special_tokens=False) == EOS_TEXT


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_false_keeps_a_special_token_in_the_text(client, stream):
    body = {"prompt": EOS_NEXT, "max_tokens": 4, **GREEDY}
    if stream:
        shown, _ = streamed_text(client, "/v1/completions", **body, skip_special_tokens=False)
        hidden, _ = streamed_text(client, "/v1/completions", **body)
    else:
        shown = post(client, "/v1/completions", **body, skip_special_tokens=False)["choices"][0]["text"]
        hidden = post(client, "/v1/completions", **body)["choices"][0]["text"]
    assert shown.startswith(EOS_TEXT) and shown.replace(EOS_TEXT, "") == hidden and hidden


# ---- echo on chat -----------------------------------------------------------------------------

def test_chat_echo_starts_the_answer_with_the_last_assistant_message(client):
    messages = [*MESSAGES, {"role": "assistant", "content": "Hello, I am"}]
    body = {"messages": messages, "add_generation_prompt": False, "max_tokens": 4, **GREEDY}
    plain = post(client, "/v1/chat/completions", **body)["choices"][0]["message"]
    echoed = post(client, "/v1/chat/completions", **body, echo=True)["choices"][0]["message"]
    assert echoed["role"] == plain["role"] == "assistant"
    assert echoed["content"] == "Hello, I am" + plain["content"]
    text, chunks = streamed_text(client, "/v1/chat/completions", **body, echo=True)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"] == {"content": "Hello, I am"}
    assert text == echoed["content"]


def test_chat_echo_adds_nothing_after_a_user_message_and_the_role_follows_vllm(client):
    body = {"messages": MESSAGES, "max_tokens": 3, **GREEDY}
    plain = post(client, "/v1/chat/completions", **body)["choices"][0]["message"]
    assert post(client, "/v1/chat/completions", **body, echo=True)["choices"][0]["message"] == plain
    # without a generation prompt the answer goes on the last message, in its role
    cont = post(client, "/v1/chat/completions", **body, add_generation_prompt=False, echo=True)["choices"][0]
    assert cont["message"]["role"] == "user" and cont["message"]["content"].startswith("Say hello.")


# ---- prompt_logprobs --------------------------------------------------------------------------

def test_prompt_logprobs_give_each_prompt_token_its_logprob_rank_and_top(client):
    ids = post(client, "/tokenize", prompt=PROMPT)["tokens"]
    body = post(client, "/v1/completions", prompt=PROMPT, max_tokens=1, temperature=0, prompt_logprobs=2)
    scores = body["choices"][0]["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    echo = post(client, "/v1/completions", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    want = echo["choices"][0]["logprobs"]["token_logprobs"]
    # vLLM: echo with logprobs asks for prompt_logprobs too (as many alternatives as logprobs)
    assert [e if e is None else list(e) for e in echo["choices"][0]["prompt_logprobs"]] == \
        [None] + [[str(t)] for t in ids[1:]]
    ranked_below_top = 0
    for t, entry, lp in zip(ids[1:], scores[1:], want[1:], strict=True):
        mine = entry[str(t)]
        assert mine["logprob"] == pytest.approx(lp, abs=1e-5)
        assert mine["decoded_token"] == post(client, "/detokenize", tokens=[t])["prompt"]
        ranks = sorted(v["rank"] for v in entry.values())
        by_rank = sorted(entry.values(), key=lambda v: v["rank"])
        assert [v["logprob"] for v in by_rank] == sorted((v["logprob"] for v in by_rank), reverse=True)
        if mine["rank"] <= 2:
            assert ranks == [1, 2]
        else:
            assert ranks == [1, 2, mine["rank"]]
            ranked_below_top += 1
    assert ranked_below_top, "a random model's prompt should hold tokens outside its top 2"
    # 0: the token alone; not asked: no field
    zero = post(client, "/v1/completions", prompt=PROMPT, max_tokens=1, prompt_logprobs=0)["choices"][0]
    assert all(e is None or list(e) == [str(t)] for t, e in zip(ids, zero["prompt_logprobs"], strict=True))
    assert "prompt_logprobs" not in post(client, "/v1/completions", prompt=PROMPT, max_tokens=1)["choices"][0]


def test_prompt_logprobs_through_the_openai_client_and_refused_in_a_stream(real_server, client):
    oai = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)
    out = oai.completions.create(model="granite-tiny", prompt=PROMPT, max_tokens=1,
                                 extra_body={"prompt_logprobs": 1})
    scores = out.choices[0].model_extra["prompt_logprobs"]
    assert scores[0] is None and all(e for e in scores[1:])
    err = post(client, "/v1/completions", 400, prompt=PROMPT, stream=True, prompt_logprobs=1)["error"]
    assert err["param"] == "prompt_logprobs" and "not available when stream" in err["message"]


# ---- X-Request-Id, /version, /ping ----------------------------------------------------------

def test_x_request_id_names_the_response_and_comes_back(client):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                    headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert r.json()["id"] == "cmpl-trace-42"
    body = {"messages": MESSAGES, "max_tokens": 1, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-43"}) as r:
        assert r.headers["x-request-id"] == "trace-43"
        assert all(e["id"] == "chatcmpl-trace-43" for e in sse_events(r)[:-1])
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    assert r.headers["x-request-id"] == r.json()["id"]  # the id the server made
    assert client.get("/health", headers={"X-Request-Id": "probe"}).headers["x-request-id"] == "probe"
    r = client.post("/v1/completions", json={"prompt": PROMPT}, headers={"X-Request-Id": "x" * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"


def test_two_requests_may_share_an_x_request_id(real_server):
    body = {"prompt": PROMPT, "max_tokens": 6, **GREEDY}

    async def both():
        async with httpx.AsyncClient(base_url=real_server.url, timeout=600) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json=body, headers={"X-Request-Id": "same"})
                                          for _ in range(2)])

    a, b = asyncio.run(both())
    assert a.status_code == b.status_code == 200
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    assert a.json()["usage"]["completion_tokens"] == b.json()["usage"]["completion_tokens"] == 6


def test_version_and_ping_answer_as_vllm(client):
    from spyre_serve.server.openai.status import version

    assert client.get("/version").json() == {"version": version()} and version() != "unknown"
    assert client.get("/ping").status_code == client.post("/ping").status_code == 200


# ---- --chat-template and generation_config.json ----------------------------------------------

def app_over(real_server, model_path, **settings):
    """A server of its own over the session's engine, for another model directory or flags."""
    built = real_server.built
    model = SimpleNamespace(name="granite-tiny", path=model_path, config=built.model.config,
                            tokenizer=built.model.tokenizer)
    return ServerThread(create_app(built.engine, model, Settings(**settings)))


def test_the_chat_template_flag_reads_a_file(real_server, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    with app_over(real_server, real_server.built.model.path, chat_template=str(template)) as server:
        with httpx.Client(base_url=server.url, timeout=600) as c:
            ids = post(c, "/tokenize", messages=MESSAGES)["tokens"]
            assert post(c, "/detokenize", tokens=ids)["prompt"] == "[user] Say hello.\n[assistant] "
            r = post(c, "/v1/chat/completions", messages=MESSAGES, max_tokens=2, **GREEDY)
            assert r["usage"]["prompt_tokens"] == len(ids)


@pytest.fixture(scope="module")
def generation_config_dir(real_server, tmp_path_factory):
    """granite-tiny's files, with a generation_config.json that asks for greedy sampling and
    at most 5 new tokens."""
    src = real_server.built.model.path
    dst = tmp_path_factory.mktemp("granite-tiny-generation-config")
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (dst / f.name).symlink_to(f.resolve())
    gen = json.loads((src / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0, "top_k": 50,
                                                            "max_new_tokens": 5}))
    return dst


def test_generation_config_defaults_apply_to_what_a_request_leaves_unset(real_server, generation_config_dir,
                                                                          greedy):
    want = greedy["choices"][0]["logprobs"]["tokens"]
    with app_over(real_server, generation_config_dir) as server:
        with httpx.Client(base_url=server.url, timeout=600) as c:
            def tokens(**body) -> list[str]:
                r = post(c, "/v1/completions", prompt=PROMPT, ignore_eos=True, logprobs=0, **body)
                return r["choices"][0]["logprobs"]["tokens"]

            assert tokens() == want[:5]  # greedy, and max_tokens (16) capped at max_new_tokens
            assert tokens(max_tokens=3) == want[:3]
            assert tokens(max_tokens=8) == want[:5]
            seeded = [tokens(temperature=1.0, seed=s) for s in range(4)]
            assert any(t != want[:5] for t in seeded)  # the request's own temperature wins
            chat = post(c, "/v1/chat/completions", messages=MESSAGES, ignore_eos=True)
            assert chat["usage"]["completion_tokens"] == 5
    with app_over(real_server, generation_config_dir, generation_config="vllm") as server:
        with httpx.Client(base_url=server.url, timeout=600) as c:
            r = post(c, "/v1/completions", prompt=PROMPT, ignore_eos=True, temperature=0)
            assert r["usage"]["completion_tokens"] == 16


# ---- metrics ----------------------------------------------------------------------------------

def test_metrics_count_iteration_tokens_max_tokens_and_preemptions(client, greedy):
    post(client, "/v1/completions", prompt=PROMPT, max_tokens=7, **GREEDY)
    values = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    label = 'model_name="granite-tiny"'
    assert values[f"vllm:num_preemptions_total{{{label}}}"] >= 0  # counted: tests/server/sched/test_e2e_preemption.py
    assert values[f"vllm:request_params_max_tokens_count{{{label}}}"] >= 2
    assert values[f'vllm:request_params_max_tokens_bucket{{le="10.0",{label}}}'] >= 1  # the 7 just asked
    assert values[f'vllm:request_params_max_tokens_bucket{{le="1000.0",{label}}}'] == \
        values[f"vllm:request_params_max_tokens_count{{{label}}}"]
    steps = values[f"vllm:iteration_tokens_total_count{{{label}}}"]
    assert steps >= 7 and values[f"vllm:iteration_tokens_total_sum{{{label}}}"] >= steps


def test_up_to_20_logprobs_as_vllms_default_max_logprobs(client):
    out = post(client, "/v1/completions", prompt="The sky is", max_tokens=2, **GREEDY, logprobs=20)["choices"][0]
    # a completion's alternatives are a dict by text: two tokens of one text are one entry
    assert all(15 < len(top) <= 20 for top in out["logprobs"]["top_logprobs"])
    chat = post(client, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                **GREEDY, logprobs=True, top_logprobs=20)["choices"][0]["logprobs"]["content"]
    assert [len(t["top_logprobs"]) for t in chat] == [20, 20]
    assert all([a["logprob"] for a in t["top_logprobs"]] == sorted((a["logprob"] for a in t["top_logprobs"]),
                                                                   reverse=True) for t in chat)
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
