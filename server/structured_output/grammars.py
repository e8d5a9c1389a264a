"""Structured output: grammars compiled with llguidance, one matcher per sequence, its token mask
a step input.

    grammars = Grammars(tokenizer, vocab_size, eos_ids)   # one per server
    grammar = grammars.compile(GrammarSpec("json", schema_text))   # blocking: run it off the
                                                                    # event loop; LRU-cached
    matcher = grammar.matcher()                # one per sequence (a copy of the compiled start)
    matcher.fill(words)                        # int32[ceil(V/32)]: the tokens allowed next
    matcher.advance(token)                     # the sampled token; True once only EOS may follow

Why llguidance: it builds the mask of a 49k vocabulary in tens of microseconds per token (a
token trie walked with the lexer's states, no per-token regex), needs no torch at serving time
(xgrammar's Python package pulls torch and triton), and is a 3 MB wheel. Its bitmask (bit t % 32
of int32 word t // 32 allows token t) is what the step's sampling kernel reads
(``device.kernels.sampling.apply_token_mask``).

Compiling a grammar (a JSON schema, a regex, a list of choices, a Lark/GBNF grammar) takes from
a millisecond to a few hundred; it happens when the request arrives, on the API layer's worker
threads (``server/openai/offload.py``), never on the event loop or the engine thread. Compiled
grammars are kept in an LRU cache keyed by (kind, source), so a schema sent again costs one
``deep_copy`` per sequence. An invalid grammar raises ``GrammarError`` naming the problem (the
API layer makes it a 400).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("spyre_serve.engine")

CACHE_SIZE = 128  # compiled grammars kept (each a few KB to a few MB for large schemas)
# ... and at most this much of their sources: a compiled JSON schema holds ~70x its source's
# bytes (a 16 KB schema, granite-tiny's vocabulary: 1.1 MB), so 128 large schemas would hold
# ~140 MB; this keeps ~18 MB of them. Measured by benchmarks/flood.py's schema hole.
CACHE_SOURCE_BYTES = 256 << 10
# JSON as the grammar writes it: no free whitespace between tokens (a model that may put
# any amount of whitespace can spend its whole budget on it), ", " and ": " as separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """A grammar llguidance refuses: the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What to constrain the output to. ``kind``: "json" (``source`` a JSON schema as text),
    "regex", "choice" (``source`` a JSON list of strings) or "grammar" (Lark or GBNF)."""

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")


def json_spec(schema) -> GrammarSpec:
    """A JSON-schema grammar, its source canonical (sorted keys) so equal schemas share a cache entry."""
    return GrammarSpec("json", json.dumps(schema, sort_keys=True, separators=(",", ":")))


class Grammar:
    """A compiled grammar: the matcher at its start, copied for each sequence."""

    __slots__ = ("spec", "_start", "_words", "_lock")

    def __init__(self, spec: GrammarSpec, start, words: int) -> None:
        self.spec = spec
        self._start = start
        self._words = words
        self._lock = threading.Lock()

    def __reduce__(self):
        """Pickled (to the engine's process): its spec, compiled there again (``serve_grammars``)."""
        return (_compiled, (self.spec,))

    def matcher(self) -> Matcher:
        with self._lock:
            return Matcher(self._start.deep_copy(), self._words)


class Matcher:
    """One sequence's place in its grammar. Not thread-safe: the engine thread alone uses it."""

    __slots__ = ("_m", "words", "failed")

    def __init__(self, matcher, words: int) -> None:
        self._m = matcher
        self.words = words             # int32 words of a mask: ceil(V / 32)
        self.failed: str | None = None  # why the grammar could not go on (llguidance's error)

    def fill(self, out: np.ndarray) -> None:
        """Write the mask of the tokens allowed next into ``out`` (int32[words], C-contiguous)."""
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self._m.is_error():
            self.failed = _first_line(self._m.get_error())

    def mask(self) -> np.ndarray:
        out = np.empty(self.words, np.int32)
        self.fill(out)
        return out

    def advance(self, token: int) -> bool:
        """Consume the sampled ``token``; True once the grammar is complete and only EOS may
        follow (the sequence is done), or it failed (``failed`` says why)."""
        if not self._m.consume_token(int(token)) or self._m.is_error() or self.failed:
            # refused, or llguidance gave up (a stop with an error: its lexer past its limits)
            self.failed = self.failed or _first_line(self._m.get_error()) or \
                f"token {token} is not allowed by the grammar"
            return True
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()


def _first_line(error: str | None) -> str | None:
    """llguidance's error without the parser state and grammar it appends."""
    return error.strip().splitlines()[0] if error and error.strip() else error


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for ``spec`` (not yet checked: ``Grammars.compile`` does)."""
    import llguidance

    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, overrides=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        choices = json.loads(spec.source)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    try:
        return llguidance.grammar_from("grammar", spec.source)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


class Grammars:
    """The server's grammar compiler and cache (thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, cache_size: int = CACHE_SIZE,
                 cache_source_bytes: int = CACHE_SOURCE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(int(t) for t in eos_ids)
        self.words = (vocab_size + 31) // 32
        self.cache_size = cache_size
        self.cache_source_bytes = cache_source_bytes
        self._source_bytes = 0   # of the cached specs' sources
        self._cache: OrderedDict[GrammarSpec, Grammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self._lltok = None
        self.compiles = 0              # grammars compiled (not served from the cache)

    def ll_tokenizer(self):
        """llguidance's view of the tokenizer, built once (~0.1 s for 8k tokens, ~1 s for 49k)."""
        with self._lock:
            if self._lltok is None:
                import llguidance.hf

                eos = self.eos_ids or None
                self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=eos)
            return self._lltok

    def cached(self, spec: GrammarSpec) -> bool:
        """Whether ``spec`` was compiled (or refused) before and is still in the cache."""
        with self._lock:
            return spec in self._cache

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar of ``spec`` (cached); ``GrammarError`` when it is invalid (also
        cached, so a bad schema sent again is refused at once)."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
        if hit is None:
            hit = self._compile(spec)
            with self._lock:
                if spec not in self._cache:
                    self._source_bytes += len(spec.source)
                self._cache[spec] = hit
                self._cache.move_to_end(spec)
                while len(self._cache) > 1 and (len(self._cache) > self.cache_size
                                                or self._source_bytes > self.cache_source_bytes):
                    self._source_bytes -= len(self._cache.popitem(last=False)[0].source)
        if isinstance(hit, GrammarError):
            raise hit
        return hit

    def _compile(self, spec: GrammarSpec) -> Grammar | GrammarError:
        import llguidance

        tok = self.ll_tokenizer()
        try:
            text = grammar_text(spec)
        except (ValueError, TypeError) as exc:
            return GrammarError(str(exc))
        start = llguidance.LLMatcher(tok, text, log_level=0)
        self.compiles += 1
        if start.is_error():
            return GrammarError(start.get_error())
        return Grammar(spec, start, self.words)


def grammar_stop(seq, token: int) -> tuple[str, str | None] | None:
    """Advance ``seq``'s matcher with the token that just joined it: ("stop", None) once its
    grammar is complete (only EOS may follow: the reply is whole, as vLLM ends it), else None.
    A matcher that fails (llguidance gave up on the grammar: a lexer past its limits, a token its
    mask did not allow) ends the sequence with ("error", why), logged: a reply cut there would not
    hold to the grammar, so none is given (the engine answers it as the request's fault, a 400)."""
    if not seq.matcher.advance(token):
        return None
    if seq.matcher.failed:
        log.warning("seq %s: the grammar cannot go on: %s", seq.seq_id, seq.matcher.failed)
        return "error", (f"the structured output's grammar could not go on after {seq.num_generated} tokens "
                         f"({seq.matcher.failed}): simplify the schema, regex or grammar")
    seq.append_text(seq.detok.flush())
    return "stop", None


_SERVED: list[Grammars] = []   # this process's grammars, compiling those that arrive pickled


def serve_grammars(grammars: Grammars) -> None:
    """Compile every grammar unpickled in this process (the engine's) with ``grammars``."""
    _SERVED[:] = [grammars]


def _compiled(spec: GrammarSpec) -> Grammar:
    if not _SERVED:
        raise GrammarError("this process compiles no grammars (serve_grammars was not called)")
    return _SERVED[0].compile(spec)
