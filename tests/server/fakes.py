"""A small deterministic runner and tokenizer for fast engine/scheduler tests.

The fake runner keeps a real paged "KV cache" of token ids: each step writes
its tokens into the slots its block table names and reads the whole context
back through the block table. The next token is a hash of that context, so a
wrong block table, a block shared by two sequences, a wrong ``start_pos`` or a
bad recompute after preemption changes the output, and the tests see it.
It also checks every step against the runner's contract (budget, from_device
only right after a sampling launch, block table coverage).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders
from tokenizers import models as tokenizer_models

from spyre_serve.models import StepOutput

VOCAB = 40
EOS = 0
ALPHABET = " abcdefghijklmnopqrstuvwxyz.,!?-0123456"  # id i (1..39) -> ALPHABET[i - 1]


def _backend() -> Tokenizer:
    """A ``tokenizers.Tokenizer`` whose tokens are ALPHABET's characters, concatenated when
    decoded, and the special ``<eos>`` (id 0): what the engine's detokenizer steps with."""
    vocab = {"<eos>": EOS, **{c: i + 1 for i, c in enumerate(ALPHABET)}}
    backend = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<eos>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken("<eos>", special=True)])
    return backend


class FakeTokenizer:
    """One character per token; id 0 is the special EOS token."""

    eos_token_id = EOS

    def __init__(self) -> None:
        self.backend_tokenizer = _backend()

    def encode(self, text: str) -> list[int]:
        return [ALPHABET.index(c) + 1 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True, **_) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def next_token(context: list[int], eos_every: int = 0) -> int:
    """The fake model: a hash of the whole context. EOS when ``eos_every`` divides it."""
    h = 7
    for pos, t in enumerate(context):
        h = (h * 31 + t * (pos + 3)) % 1_000_003
    if eos_every and h % eos_every == 0:
        return EOS
    return 1 + h % (VOCAB - 1)


def reference(prompt: list[int], max_tokens: int, eos_every: int = 0, ignore_eos=False,
              min_tokens: int = 0, stop_token_ids=()) -> list[int]:
    """What greedy generation of ``prompt`` alone gives. Before ``min_tokens`` tokens the
    stop tokens (EOS unless ignore_eos, stop_token_ids) are banned: the next unbanned id."""
    stops = set(stop_token_ids) | (set() if ignore_eos else {EOS})
    ctx = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = next_token(ctx, eos_every)
        while len(out) < min_tokens and t in stops:
            t = (t + 1) % VOCAB
        out.append(t)
        ctx.append(t)
        if t in stops:
            break
    return out


class _Handle:
    def __init__(self, out: StepOutput | None, error: Exception | None, events: list, index: int) -> None:
        self._out = out
        self._error = error
        self._events = events
        self._index = index

    def result(self) -> StepOutput:
        self._events.append(("result", self._index))
        if self._error is not None:
            raise self._error
        return self._out


@dataclass
class FakeRunner:
    num_kv_blocks: int = 64
    block_size: int = 4
    max_model_len: int = 256
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    eos_every: int = 0
    fail_when_token: int | None = None  # a step containing this prompt token fails
    launches: list = field(default_factory=list)  # the work of every launch
    violations: list = field(default_factory=list)
    events: list = field(default_factory=list)  # ("launch", i) and ("result", i) in call order
    config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(vocab_size=VOCAB,
                                                                            eos_token_id=None))
    numerics: str = "fake"
    pooling: tuple | None = None         # a generating runner

    def __post_init__(self) -> None:
        self.kv = np.full((self.num_kv_blocks, self.block_size), -2, dtype=np.int64)
        self._sampled_last_launch: dict[int, int] = {}

    def _check(self, ok: bool, message: str) -> None:
        if not ok:
            self.violations.append(message)

    def forget(self, seq_id: int) -> None:
        """The fake keeps nothing per sequence between steps."""

    def launch(self, work):
        self.events.append(("launch", len(self.launches)))
        self.launches.append(work)
        total = sum(len(w.token_ids) for w in work)
        self._check(total <= self.max_num_batched_tokens, f"{total} tokens in one step")
        self._check(len(work) <= self.max_num_seqs, f"{len(work)} seqs in one step")
        self._check(len({w.seq_id for w in work}) == len(work), "a seq twice in one step")
        error = None
        if self.fail_when_token is not None and any(self.fail_when_token in w.token_ids for w in work):
            error = RuntimeError("injected device fault")
        seq_ids, tokens, lps, plps = [], [], [], {}
        sampled = {}
        k = max([w.sampling.logprobs for w in work if w.sample] + [0])
        for w in work:
            ids = list(w.token_ids)
            if w.from_device:
                self._check(w.seq_id in self._sampled_last_launch, f"seq {w.seq_id} from_device without a sample")
                ids = [self._sampled_last_launch.get(w.seq_id, 1)]
            end = w.start_pos + len(ids)
            self._check(len(w.block_table) * self.block_size >= end, f"seq {w.seq_id} block table too short")
            self._check(all(0 <= b < self.num_kv_blocks for b in w.block_table), "bad block id")
            for j, t in enumerate(ids):
                pos = w.start_pos + j
                self.kv[w.block_table[pos // self.block_size], pos % self.block_size] = t
            context = [int(self.kv[w.block_table[p // self.block_size], p % self.block_size]) for p in range(end)]
            self._check(all(t >= 0 for t in context), f"seq {w.seq_id} reads an unwritten slot")
            if w.prompt_logprobs:
                # token_ids[1:], plus the first token when an earlier chunk predicted it
                scored = ids if w.start_pos > 0 else ids[1:]
                n = len(scored)
                plps[w.seq_id] = (
                    np.array([-0.5 - 0.01 * t for t in scored], dtype=np.float32),
                    np.array([[t] * k for t in scored], dtype=np.int32).reshape(n, k),
                    np.full((n, k), -0.5, dtype=np.float32),
                    np.ones(n, dtype=np.int32),  # each token its row's most likely
                )
            if w.sample:
                t = next_token(context, self.eos_every)
                ban = set(w.banned_token_ids or ())
                self._check(all(0 <= b < VOCAB for b in ban), f"seq {w.seq_id} bans {sorted(ban)}")
                while t in ban and len(ban) < VOCAB:  # as the device: the next best unbanned
                    t = (t + 1) % VOCAB
                seq_ids.append(w.seq_id)
                tokens.append(t)
                lps.append(-0.25 - 0.01 * t)
                sampled[w.seq_id] = t
        self._sampled_last_launch = sampled
        s = len(seq_ids)
        top_ids = np.array([[t + j for j in range(k)] for t in tokens], dtype=np.int32).reshape(s, k)
        out = StepOutput(
            seq_ids=seq_ids,
            token_ids=np.array(tokens, dtype=np.int32),
            logprobs=np.array(lps, dtype=np.float32),
            top_ids=top_ids % VOCAB,
            top_logprobs=np.full((s, k), -1.0, dtype=np.float32),
            prompt_logprobs=plps,
        )
        return _Handle(None if error else out, error, self.events, len(self.launches) - 1)


class Collector:
    """An engine request's ``on_update``: keeps every update, signals the finishing one."""

    def __init__(self) -> None:
        self.updates = []
        self.done = threading.Event()

    def __call__(self, update) -> None:
        self.updates.append(update)
        if update.finish_reason is not None:
            self.done.set()

    def wait(self, timeout: float = 20):
        assert self.done.wait(timeout), "request did not finish"
        return self

    @property
    def token_ids(self):
        return [t for u in self.updates for t in u.token_ids]

    @property
    def text(self):
        return "".join(u.text for u in self.updates)

    @property
    def last(self):
        return self.updates[-1]
