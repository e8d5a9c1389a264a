"""limits.py: the caps on one request (prompts, n, stop strings and ids, its sequences)."""

from __future__ import annotations

import pytest

from spyre_serve.server.launch.settings import Settings
from spyre_serve.server.openai.errors import APIError
from spyre_serve.server.openai.generation.protocol import ChatCompletionRequest, CompletionRequest
from spyre_serve.server.openai.limits import check_limits, num_prompts

SMALL = Settings(max_n=4, max_prompts=3, max_stop_strings=2, max_stop_length=5, max_stop_token_ids=2,
                 max_waiting=6)


def refused(req, settings=SMALL) -> APIError:
    with pytest.raises(APIError) as info:
        check_limits(req, num_prompts(req), settings)
    assert info.value.status == 400
    return info.value


def completion(**body) -> CompletionRequest:
    return CompletionRequest(**{"prompt": "x", **body})


@pytest.mark.parametrize(("prompt", "count"), [("a", 1), (["a", "b"], 2), ([1, 2, 3], 1), ([[1], [2]], 2)])
def test_a_prompt_counts_as_the_prompts_it_holds(prompt, count):
    assert num_prompts(completion(prompt=prompt)) == count


def test_a_chat_is_one_prompt():
    assert num_prompts(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])) == 1


def test_requests_within_every_limit_pass():
    check_limits(completion(prompt=["a", "b", "c"], n=2, stop=["ab", "abcde"], stop_token_ids=[1, 2]), 3, SMALL)


def test_too_many_prompts_is_a_400_naming_the_flag():
    err = refused(completion(prompt=["a"] * 4))
    assert (err.param, err.message) == ("prompt", "prompt is a list of 4 prompts, the limit is 3 (--max-prompts)")


def test_n_over_the_limit_is_a_400_naming_n():
    err = refused(completion(n=5))
    assert (err.param, err.message) == ("n", "n must be at most 4, got 5")


def test_too_many_stop_strings_is_a_400():
    err = refused(completion(stop=["a", "b", "c"]))
    assert (err.param, err.message) == ("stop", "stop has 3 strings, the limit is 2 (--max-stop-strings)")


def test_a_stop_string_too_long_is_a_400_naming_its_length():
    err = refused(completion(stop=["a", "abcdef"]))
    assert (err.param, err.message) == (
        "stop", "stop string 1 is 6 characters long, the limit is 5 (--max-stop-length)")


def test_too_many_stop_token_ids_is_a_400():
    err = refused(completion(stop_token_ids=[1, 2, 3]))
    assert (err.param, err.message) == (
        "stop_token_ids", "stop_token_ids has 3 ids, the limit is 2 (--max-stop-token-ids)")


def test_a_request_with_more_sequences_than_the_waiting_queue_holds_is_a_400():
    err = refused(completion(prompt=["a", "b"], n=4))
    assert (err.param, err.message) == (
        "n", "this request asks for 8 sequences (2 prompts x n = 4), more than the 6 the waiting queue "
             "holds (--max-waiting)")
