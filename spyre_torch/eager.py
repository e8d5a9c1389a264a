"""transformers' own model run eagerly on "spyre": the PyTorch user's path, op by op through
torch's dispatcher, each op one launch of a prepared card program (benchmarks/model.py
measures the serving program path against it).

    from spyre_torch.eager import EagerModel
    m = EagerModel.load("/path/to/checkpoint")           # fp32, eval, on "spyre"
    first = m.prefill(prompt_ids)                        # one forward over the prompt -> next token
    rest = m.decode(first, steps=32)                     # 32 forwards of one token each (greedy)
    m.stats                                              # Phase of the last call: seconds, launches,
                                                         # card compute seconds, fallbacks...

    EagerModel.measure(path, prompt_tokens=1024, decode_tokens=32)   # both phases, timed (best of 2)

Each call ends when its tokens are on the host (a `.cpu()` per step, as a generation loop
does), so its wall time covers dispatch and the card's compute. `Phase` splits it with the
card's counters: `launch_host_seconds` (host time inside Program.launch), `compute_seconds`
(the card computing), the rest being torch's dispatch and the Python op code. The same
methods run on "cpu" for the transformers reference (`device="cpu"`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class Phase:
    """One prefill or decode call: wall seconds, tokens, and the card's counters over it."""
    name: str
    seconds: float
    tokens: int
    launches: int = 0
    compute_seconds: float = 0.0
    launch_host_seconds: float = 0.0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    compiles: int = 0
    fallbacks: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def dispatch_seconds(self) -> float:
        """Wall time neither computing on the card nor inside Program.launch: torch's dispatch
        and the ops' Python (with the host and card overlapping, an estimate)."""
        return max(0.0, self.seconds - self.compute_seconds - self.launch_host_seconds)


def _counters(device: str) -> dict:
    if device != "spyre":
        return {}
    return torch.spyre.counters()


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _delta(before: dict, after: dict, key: str):
    return after.get(key, 0) - before.get(key, 0)


class EagerModel:
    """A transformers causal LM on `device`, with a greedy prefill / decode loop."""

    def __init__(self, model, device: str = "spyre"):
        import inspect

        self.model = model
        # transformers 5 names the KV cache argument `cache` (4.x: `past_key_values`)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.device = device
        self.cache = None
        self.position = 0
        self.stats: Phase | None = None

    @classmethod
    def load(cls, path, device: str = "spyre") -> EagerModel:
        """transformers' AutoModelForCausalLM for the checkpoint at `path`, fp32, eval, moved
        to `device` ("spyre" or "cpu")."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
        if getattr(model.config, "tie_word_embeddings", False):
            # Module.to() replaces each parameter by a new one for a device whose tensors
            # torch cannot swap in place (as here): a tied LM head becomes a second copy
            model.tie_weights()
        return cls(model, device)

    def _phase(self, name: str, tokens: int, fn):
        before = _counters(self.device)
        fallbacks = torch.spyre.fallback_counts() if self.device == "spyre" else {}
        t0 = time.perf_counter()
        with torch.no_grad():
            result = fn()
        seconds = time.perf_counter() - t0
        after = _counters(self.device)
        now = torch.spyre.fallback_counts() if self.device == "spyre" else {}
        self.stats = Phase(
            name, seconds, tokens,
            launches=_delta(before, after, "launches"),
            compute_seconds=_delta(before, after, "compute_seconds"),
            launch_host_seconds=_delta(before, after, "launch_host_seconds"),
            h2d_bytes=_delta(before, after, "h2d_bytes"),
            d2h_bytes=_delta(before, after, "d2h_bytes"),
            compiles=_delta(before, after, "compiles"),
            fallbacks={k: v - fallbacks.get(k, 0) for k, v in now.items() if v != fallbacks.get(k, 0)})
        return result

    def prefill(self, input_ids) -> int:
        """One forward over the prompt (a list of ids or a [1, T] tensor); keeps the KV cache;
        returns the greedy next token (read to the host)."""
        ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(1, -1)

        def run():
            out = self.model(ids.to(self.device), use_cache=True)
            self.cache = _cache_of(out)
            return int(out.logits[0, -1].argmax().cpu())
        self.position = ids.shape[1]
        return self._phase("prefill", ids.shape[1], run)

    def decode(self, token: int, steps: int) -> list[int]:
        """`steps` greedy steps after `token`, each one forward of one token on the KV cache
        and its next token read to the host; returns the tokens produced."""
        if self.cache is None:
            raise RuntimeError("decode before prefill: there is no KV cache")

        def run():
            produced, tok = [], token
            for _ in range(steps):
                x = torch.tensor([[tok]], dtype=torch.int64).to(self.device)
                out = self.model(x, use_cache=True, **{self._cache_arg: self.cache})
                self.cache = _cache_of(out)
                tok = int(out.logits[0, -1].argmax().cpu())
                produced.append(tok)
            return produced
        tokens = self._phase("decode", steps, run)
        self.position += steps
        return tokens

    @classmethod
    def measure(cls, path, prompt_tokens: int = 1024, decode_tokens: int = 32,
                device: str = "spyre", warmup: bool = True, repeats: int = 2,
                seed: int = 0) -> dict:
        """Load, then time one prefill of `prompt_tokens` random ids and `decode_tokens` decode
        steps after it, `repeats` times, keeping each phase's fastest run (the first run at a
        size also touches fresh pages of the card's arena). `warmup`: one short prefill +
        decode first, so that every card kernel is compiled (or loaded from Numba's cache)
        before timing. Returns {"prefill": Phase, "decode": Phase, "tokens": [...]} (the
        tokens of the last run; greedy, so every run's)."""
        m = cls.load(path, device)
        g = torch.Generator().manual_seed(seed)
        vocab = m.model.config.vocab_size
        ids = torch.randint(0, vocab, (prompt_tokens,), generator=g)
        if warmup:
            m.decode(m.prefill(ids[:8]), 2)
        best: dict = {}
        for _ in range(max(1, repeats)):
            first = m.prefill(ids)
            best["prefill"] = min(best.get("prefill", m.stats), m.stats, key=lambda p: p.seconds)
            tokens = m.decode(first, decode_tokens)
            best["decode"] = min(best.get("decode", m.stats), m.stats, key=lambda p: p.seconds)
        return {"prefill": best["prefill"], "decode": best["decode"], "tokens": [first, *tokens]}
