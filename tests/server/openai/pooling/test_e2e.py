"""/v1/embeddings and /score through a real uvicorn server, a decoder served with
--runner pooling (granite-tiny, last-token pooling, normalized: vLLM's default for a decoder):
every answer against transformers' `last_hidden_state` of the same tokens, the official openai
client's call (base64), batching, and the 400s (a generation request to this server, an
embedding request to a generating one, an input over the context, dimensions) that leave
nothing behind."""

from __future__ import annotations

import base64
import concurrent.futures

import httpx
import numpy as np
import pytest

from spyre_serve.models.sizing.projection import StepShape
from tests.server.servers import POOLING_CONTEXT as CONTEXT
from tests.server.servers import ServerThread, http_client, real_settings

TEXTS = ["The quick brown fox", "jumps over the lazy dog and keeps running far away", "Then"]


@pytest.fixture(scope="module")
def http(pooling_server):
    yield from http_client(pooling_server)


@pytest.fixture(scope="module")
def reference(pooling_server):
    """Unit vector of the last token's final hidden state of each token list (transformers)."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(pooling_server.built.model.path, dtype=torch.float32).eval()

    def embed(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            v = model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
        return v / np.linalg.norm(v)
    return embed


def tokens(http, text: str) -> list[int]:
    r = http.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def assert_projected(usage: dict) -> None:
    """An embedding answer's usage carries its steps on a real card, as a generation's does:
    each input's whole prompt in one step, so no later steps."""
    spyre = usage["spyre"]
    assert set(spyre) == {"projected_ttft_seconds", "projected_tpot_seconds", "projected_seconds"}
    assert 0 < spyre["projected_ttft_seconds"] <= spyre["projected_seconds"]
    assert spyre["projected_tpot_seconds"] == 0.0


def assert_close(got, want):
    got = np.asarray(got, np.float32)
    assert 1.0 - float(got @ want) / float(np.linalg.norm(got)) <= 1e-5
    np.testing.assert_allclose(got, want, atol=3e-5)


def test_embeddings_of_texts_equal_transformers(http, reference, pooling_server):
    r = http.post("/v1/embeddings", json={"input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "granite-tiny"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    ids = [tokens(http, t) for t in TEXTS]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["total_tokens"]) == (sum(map(len, ids)), sum(map(len, ids)))
    assert_projected(usage)                               # the decoder's steps, projected
    for d, i in zip(body["data"], ids, strict=True):
        assert d["object"] == "embedding" and len(d["embedding"]) == pooling_server.built.model.config.hidden_size
        assert_close(d["embedding"], reference(i))
    alone = http.post("/v1/embeddings", json={"input": TEXTS[1]}).json()["data"][0]["embedding"]
    np.testing.assert_allclose(alone, body["data"][1]["embedding"], atol=1e-6)


def test_token_id_inputs_and_base64(http, reference):
    ids = [[5, 17, 99, 3], [42]]
    floats = http.post("/v1/embeddings", json={"input": ids}).json()["data"]
    packed = http.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64"}).json()["data"]
    for f, p, i in zip(floats, packed, ids, strict=True):
        assert_close(f["embedding"], reference(i))
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(p["embedding"]), "<f4"),
                                      np.asarray(f["embedding"], np.float32))
    one = http.post("/v1/embeddings", json={"input": ids[0]}).json()["data"]
    assert len(one) == 1 and np.allclose(one[0]["embedding"], floats[0]["embedding"], atol=1e-6)


def test_official_client(pooling_server, http, reference):
    import openai

    client = openai.OpenAI(base_url=pooling_server.url + "/v1", api_key="unused")
    out = client.embeddings.create(model="granite-tiny", input=TEXTS[:2])   # base64 on the wire
    assert out.usage.prompt_tokens == sum(len(tokens(http, t)) for t in TEXTS[:2])
    for d, text in zip(out.data, TEXTS[:2], strict=True):
        assert_close(d.embedding, reference(tokens(http, text)))
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="granite-tiny", input="x", dimensions=8)


def test_score_is_the_cosine_of_the_embeddings(http):
    data = http.post("/v1/embeddings", json={"input": TEXTS}).json()["data"]
    vec = [np.asarray(d["embedding"], np.float64) for d in data]
    for path in ("/score", "/v1/score"):
        r = http.post(path, json={"text_1": TEXTS[0], "text_2": TEXTS[1:]})
        assert r.status_code == 200, r.text
        got = [d["score"] for d in r.json()["data"]]
        np.testing.assert_allclose(got, [vec[0] @ vec[1], vec[0] @ vec[2]], atol=1e-5)
    pairwise = http.post("/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()["data"]
    np.testing.assert_allclose([d["score"] for d in pairwise], [vec[0] @ vec[1], vec[1] @ vec[2]], atol=1e-5)
    bad = http.post("/score", json={"text_1": TEXTS[:2], "text_2": TEXTS})
    assert bad.status_code == 400 and "text_1 holds 2" in bad.json()["error"]["message"]
    # each side is checked, and named, on its own
    empty = http.post("/score", json={"text_1": "a", "text_2": ["b", ""]}).json()["error"]
    assert empty["param"] == "text_2" and "empty" in empty["message"]
    many = http.post("/score", json={"text_1": ["a"] * 200, "text_2": ["b"] * 200}).json()["error"]
    assert many["param"] == "text_2" and "more than the 256 sequences the waiting queue holds" in many["message"]


def test_concurrent_requests_share_steps(http, pooling_server):
    engine = pooling_server.built.engine
    steps = engine.stats.steps
    texts = [f"request {i}: {' '.join(['word'] * (i % 7 + 1))}" for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda t: http.post("/v1/embeddings", json={"input": t}), texts))
    assert all(r.status_code == 200 for r in answers)
    assert engine.stats.steps - steps < len(texts)         # continuous batching: prefills share steps


def test_bad_input_is_a_400_and_leaves_nothing(http, pooling_server):
    engine = pooling_server.built.engine
    free = engine.blocks.num_free
    too_long = http.post("/v1/embeddings", json={"input": list(range(1, CONTEXT + 2))})
    assert too_long.status_code == 400
    err = too_long.json()["error"]
    assert err["param"] == "input" and f"maximum context length is {CONTEXT} tokens" in err["message"]
    hidden = pooling_server.built.model.config.hidden_size
    for body, param in [({"input": []}, "input"), ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "x", "dimensions": 3}, "dimensions"),
                        ({"input": "x", "dimensions": hidden}, "dimensions"),
                        ({"input": "x", "dimensions": 0}, "dimensions"),
                        ({"input": "x", "truncate_prompt_tokens": CONTEXT + 1}, "truncate_prompt_tokens"),
                        ({"input": [1, 10**9]}, "input"), ({"input": "x", "priority": 1}, "priority")]:
        r = http.post("/v1/embeddings", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
    gen = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert gen.status_code == 400 and "serves embeddings" in gen.json()["error"]["message"]
    assert http.post("/v1/embeddings", json={"input": "still serving"}).status_code == 200
    assert engine.blocks.num_free == free and engine.num_requests == 0


def test_embedding_request_to_a_generating_server_is_a_400(client):
    r = client.post("/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]
    r = client.post("/score", json={"text_1": "a", "text_2": "b"})
    assert r.status_code == 400


def test_openapi_documents_the_pooling_bodies(http):
    spec = http.get("/openapi.json").json()
    assert {"/v1/embeddings", "/score", "/v1/score"} <= set(spec["paths"])
    assert "EmbeddingRequest" in spec["components"]["schemas"]


def test_the_engine_in_its_own_process_answers_the_same(http):
    from tests.reliability.servers import running_server

    with running_server(engine_process=True, runner="pooling", max_num_batched_tokens=CONTEXT,
                        max_num_seqs=8, max_model_len=None) as split:
        assert split.built.engine.pooling == ("LAST", True)
        with httpx.Client(base_url=split.url, timeout=300) as c:
            got = c.post("/v1/embeddings", json={"input": TEXTS}).json()["data"]
            score = c.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1]})
            gen = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    want = http.post("/v1/embeddings", json={"input": TEXTS}).json()["data"]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g["embedding"], w["embedding"], atol=1e-6)
    assert score.status_code == 200 and gen.status_code == 400


def test_metrics_count_requests_by_endpoint_and_status(http):
    def count(text: str, endpoint: str, status: str) -> float:
        for line in text.splitlines():
            if (line.startswith("spyre_api_requests_total{") and f'endpoint="{endpoint}"' in line
                    and f'status="{status}"' in line):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = http.get("/metrics").text
    assert http.post("/v1/embeddings", json={"input": "counted"}).status_code == 200
    assert http.post("/score", json={"text_1": "a", "text_2": "b"}).status_code == 200
    assert http.post("/v1/embeddings", json={"input": []}).status_code == 400
    after = http.get("/metrics").text
    assert count(after, "/v1/embeddings", "200") == count(before, "/v1/embeddings", "200") + 1
    assert count(after, "/score", "200") == count(before, "/score", "200") + 1
    assert count(after, "/v1/embeddings", "400") == count(before, "/v1/embeddings", "400") + 1


@pytest.fixture(scope="module")
def encoder_server(tmp_path_factory):
    """An XLM-R checkpoint whose sentence-transformers files ask for mean pooling, served with
    --runner auto (an encoder pools)."""
    from spyre_serve.server.launch.cli import build
    from tests.models.encoder_checkpoints import write_encoder_checkpoint

    path = write_encoder_checkpoint(tmp_path_factory.mktemp("xlmr"), xlm=True, pooling="MEAN")
    built = build(real_settings(model=str(path), max_num_batched_tokens=CONTEXT, max_num_seqs=8, max_model_len=None),
                  progress=False)
    with ServerThread(built.app) as server:
        server.built = built
        yield server
    built.engine.shutdown()


def test_an_encoder_checkpoint_serves_embeddings_equal_to_transformers(encoder_server):
    from tests.models.encoder_checkpoints import reference_pooled

    assert encoder_server.built.engine.pooling == ("MEAN", True)
    texts = ["Granite embedding models are encoders.", "one", "the host prepares the next step"]
    with httpx.Client(base_url=encoder_server.url, timeout=300) as c:
        ids = [c.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
        assert all(i[0] == 0 and i[-1] == 2 for i in ids)          # <s> ... </s>, as RoBERTa's
        body = c.post("/v1/embeddings", json={"input": texts}).json()
        alone = c.post("/v1/embeddings", json={"input": texts[1]}).json()
        too_long = c.post("/v1/embeddings", json={"input": [5] * 40})
        gen = c.post("/v1/completions", json={"prompt": "x"})
    want = reference_pooled(encoder_server.built.model.path, ids, "MEAN")
    for d, w in zip(body["data"], want, strict=True):
        assert_close(d["embedding"], w)
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    assert_projected(body["usage"])
    # alone in its step, an input's projection is the encoder projector's for its prompt
    one = alone["usage"]["spyre"]
    step = StepShape((len(ids[1]),), (len(ids[1]),), 0)
    assert one["projected_ttft_seconds"] == one["projected_seconds"] == pytest.approx(
        encoder_server.built.runner.projector.seconds(step), rel=1e-9)
    limit = encoder_server.built.runner.max_model_len       # 32: RoBERTa's 34 positions - pad - 1
    assert too_long.status_code == 400 and f"maximum context length is {limit} tokens" in too_long.text
    assert gen.status_code == 400


def test_truncation_keeps_an_encoders_special_tokens(encoder_server):
    """truncate_prompt_tokens cuts a text with the tokenizer's own truncation: <s> (what CLS
    pooling reads, and MEAN counts) and </s> stay, as vLLM tokenizes with max_length."""
    from tests.models.encoder_checkpoints import reference_pooled

    text = "the host prepares the next step while the card runs this one " * 3
    tokenizer = encoder_server.built.model.tokenizer
    want_ids = tokenizer(text, truncation=True, max_length=10)["input_ids"]
    assert want_ids[0] == 0 and want_ids[-1] == 2 and len(want_ids) == 10
    with httpx.Client(base_url=encoder_server.url, timeout=300) as c:
        body = c.post("/v1/embeddings", json={"input": text, "truncate_prompt_tokens": 10}).json()
        ids = c.post("/v1/embeddings", json={"input": list(range(5, 40)), "truncate_prompt_tokens": 10}).json()
    assert body["usage"]["prompt_tokens"] == 10
    assert_close(body["data"][0]["embedding"], reference_pooled(encoder_server.built.model.path, [want_ids], "MEAN")[0])
    assert ids["usage"]["prompt_tokens"] == 10            # token ids: their last 10


def test_a_pooling_context_over_one_step_is_refused_at_start():
    from spyre_serve.server.launch.cli import build

    with pytest.raises(ValueError, match="--max-model-len 1024 is over --max-num-batched-tokens 64"):
        build(real_settings(runner="pooling", max_num_batched_tokens=64), progress=False)
