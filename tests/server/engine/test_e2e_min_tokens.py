"""min_tokens on the real stack: EOS and stop tokens are banned on the device until then.

granite-tiny's greedy continuation of the one-token prompt [7470] is EOS at once (top-1/top-2
gap 1.6e-3, far above fp32 noise), so without min_tokens the completion is that EOS alone.
"""

from __future__ import annotations

EOS_NEXT = [7470]          # a prompt whose greedy next token is EOS
EOS_TEXT = "<|end_of_text|>"


def complete(client, **body):
    body.setdefault("temperature", 0)
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_prompt_stops_at_once_on_eos_without_min_tokens(client):
    body = complete(client, prompt=EOS_NEXT, max_tokens=8, logprobs=1)
    choice = body["choices"][0]
    assert choice["logprobs"]["tokens"] == [EOS_TEXT]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    assert choice["text"] == "" and body["usage"]["completion_tokens"] == 1


def test_min_tokens_bans_eos_until_then(client):
    n = 6
    body = complete(client, prompt=EOS_NEXT, max_tokens=24, min_tokens=n, logprobs=2)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    tokens = lp["tokens"]
    assert len(tokens) >= n and body["usage"]["completion_tokens"] == len(tokens)
    assert EOS_TEXT not in tokens[:n]
    # EOS is still the raw top token at the first step: the logprobs are those of the raw
    # distribution, the ban only changed what was sampled (the second most likely token)
    first = lp["top_logprobs"][0]
    assert max(first, key=first.get) == EOS_TEXT
    assert lp["token_logprobs"][0] == first[tokens[0]] < first[EOS_TEXT]
    if EOS_TEXT in tokens:      # EOS is allowed again from token n + 1 on, and stops
        assert tokens.index(EOS_TEXT) == len(tokens) - 1 >= n
        assert choice["finish_reason"] == "stop"
    else:
        assert len(tokens) == 24 and choice["finish_reason"] == "length"


def test_min_tokens_equal_to_max_tokens_gives_exactly_max_tokens_without_eos(client):
    body = complete(client, prompt=EOS_NEXT, max_tokens=5, min_tokens=5, logprobs=0)
    choice = body["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == 5 and EOS_TEXT not in choice["logprobs"]["tokens"]
    assert choice["finish_reason"] == "length"


def test_min_tokens_bans_a_stop_token_id_too(client):
    # with ignore_eos, greedy continues past EOS; its 2nd token (the text's first, EOS has
    # none) as a stop token id
    free = complete(client, prompt=EOS_NEXT, max_tokens=6, ignore_eos=True, logprobs=0)
    first, second = free["choices"][0]["logprobs"]["tokens"][:2]
    assert first == EOS_TEXT
    stop_id = client.post("/tokenize", json={"prompt": second}).json()["tokens"][0]
    assert client.post("/detokenize", json={"tokens": [stop_id]}).json()["prompt"] == second
    stopped = complete(client, prompt=EOS_NEXT, max_tokens=6, ignore_eos=True,
                       stop_token_ids=[stop_id])
    assert stopped["usage"]["completion_tokens"] == 2
    assert (stopped["choices"][0]["finish_reason"], stopped["choices"][0]["stop_reason"]) == ("stop", stop_id)
    body = complete(client, prompt=EOS_NEXT, max_tokens=8, min_tokens=8, ignore_eos=True,
                    stop_token_ids=[stop_id], logprobs=0)
    choice = body["choices"][0]
    assert body["usage"]["completion_tokens"] == 8 and choice["finish_reason"] == "length"
    assert second not in choice["logprobs"]["tokens"]


def test_min_tokens_in_a_batch_with_other_requests(client):
    import concurrent.futures as cf

    def run(body):
        return complete(client, **body)

    bodies = [dict(prompt=EOS_NEXT, max_tokens=10, min_tokens=4, logprobs=0),
              dict(prompt=EOS_NEXT, max_tokens=10, logprobs=0),
              dict(prompt=EOS_NEXT, max_tokens=10, min_tokens=4, logprobs=0)]
    with cf.ThreadPoolExecutor(3) as pool:
        out = list(pool.map(run, bodies))
    a, free, b = (o["choices"][0] for o in out)
    assert free["logprobs"]["tokens"] == [EOS_TEXT]      # a neighbour's ban is not this one's
    assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
    assert len(a["logprobs"]["tokens"]) >= 4 and EOS_TEXT not in a["logprobs"]["tokens"][:4]
