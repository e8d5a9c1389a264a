"""server/structured_output/grammars.py: llguidance grammars on granite-tiny's tokenizer, their cache, the
per-sequence matcher and the mask it fills (the bits the sampling kernel reads)."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from spyre_serve.models import resolve_model
from spyre_serve.models.checkpoints.tokenizer import load_tokenizer
from spyre_serve.server.structured_output.grammars import (
    GrammarError,
    Grammars,
    GrammarSpec,
    json_spec,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("granite-tiny"))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, 8192, [0])


def allowed(words, vocab=8192):
    return np.nonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab])[0]


def walk(matcher, rng, limit=200):
    """Sample uniformly among the allowed tokens until the grammar says it is complete."""
    tokens = []
    for _ in range(limit):
        tok = int(rng.choice(allowed(matcher.mask())))
        tokens.append(tok)
        if matcher.advance(tok):
            return tokens
    raise AssertionError("the grammar did not end")


def test_a_mask_walk_gives_text_the_grammar_accepts(grammars, tokenizer):
    rng = np.random.default_rng(0)
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "integer", "minimum": 0, "maximum": 9}}}
    grammar = grammars.compile(json_spec(schema))
    for _ in range(5):
        m = grammar.matcher()                       # one per sequence, from the compiled start
        value = json.loads(tokenizer.decode(walk(m, rng)))
        assert value["a"] in ("x", "y") and 0 <= value["b"] <= 9 and m.failed is None
    m = grammars.compile(GrammarSpec("regex", "[0-9]{4}")).matcher()
    assert re.fullmatch("[0-9]{4}", tokenizer.decode(walk(m, rng)))
    m = grammars.compile(GrammarSpec("choice", json.dumps(["alpha", "beta gamma"]))).matcher()
    assert tokenizer.decode(walk(m, rng)) in ("alpha", "beta gamma")


def test_once_complete_only_eos_is_allowed(grammars):
    m = grammars.compile(GrammarSpec("regex", "ab")).matcher()
    rng = np.random.default_rng(1)
    walk(m, rng)
    assert allowed(m.mask()).tolist() == [0]        # the EOS the grammar was built with


def test_compiled_grammars_are_cached_by_spec_and_errors_too(tokenizer):
    g = Grammars(tokenizer, 8192, [0], cache_size=2)
    spec = json_spec({"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}})
    first = g.compile(spec)
    same = json_spec({"properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "type": "object"})
    assert g.compile(same) is first and g.compiles == 1   # key order does not matter
    with pytest.raises(GrammarError, match="Invalid type"):
        g.compile(json_spec({"type": "nonsense"}))
    with pytest.raises(GrammarError):
        g.compile(json_spec({"type": "nonsense"}))
    assert g.compiles == 2
    g.compile(GrammarSpec("regex", "a"))                  # evicts the least recently used
    assert g.compile(spec) is not first and g.compiles == 4


@pytest.mark.parametrize("spec", [GrammarSpec("regex", "[a-"), GrammarSpec("grammar", "start: nothing_here"),
                                  GrammarSpec("grammar", "root ::= missing")])
def test_an_invalid_grammar_says_what_is_wrong(grammars, spec):
    with pytest.raises(GrammarError) as info:
        grammars.compile(spec)
    assert str(info.value).strip()


def test_mask_building_is_fast_for_the_vocabulary(grammars):
    """What the engine thread spends per structured sequence per step (granite-tiny: 8192 tokens)."""
    rng = np.random.default_rng(2)
    m = grammars.compile(json_spec({"type": "object", "properties": {"s": {"type": "string"}}})).matcher()
    times = []
    for _ in range(40):
        t0 = time.perf_counter()
        words = m.mask()
        times.append(time.perf_counter() - t0)
        tok = int(rng.choice(allowed(words)))
        if m.advance(tok):
            break
    assert np.median(times) < 0.005, times


def test_the_cache_keeps_no_more_than_its_budget_of_grammar_source(tokenizer):
    g = Grammars(tokenizer, 8192, [0], cache_size=100, cache_source_bytes=40)
    specs = [GrammarSpec("regex", f"{c}{'x' * 15}") for c in "abcd"]   # 16 bytes each
    for spec in specs:
        g.compile(spec)
    assert [g.cached(s) for s in specs] == [False, False, True, True]  # 2 x 16 <= 40 < 3 x 16
    big = GrammarSpec("regex", "y" * 100)                              # over the budget alone: kept
    g.compile(big)
    assert g.cached(big) and not any(g.cached(s) for s in specs)


def test_a_grammar_crosses_a_process_as_its_spec_and_is_compiled_there(tokenizer):
    import pickle

    from spyre_serve.server.structured_output import grammars as structured

    ours = Grammars(tokenizer, 8192, [0])
    grammar = ours.compile(GrammarSpec("regex", "ab|cd"))
    theirs = Grammars(tokenizer, 8192, [0])
    saved = list(structured._SERVED)
    try:
        structured._SERVED.clear()
        with pytest.raises(GrammarError, match="serve_grammars"):
            pickle.loads(pickle.dumps(grammar))
        structured.serve_grammars(theirs)
        copy = pickle.loads(pickle.dumps(grammar))
    finally:
        structured._SERVED[:] = saved
    assert copy is not grammar and copy.spec == grammar.spec and theirs.compiles == 1
    assert allowed(copy.matcher().mask()).tolist() == allowed(grammar.matcher().mask()).tolist()
