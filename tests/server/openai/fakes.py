"""Small fakes for the OpenAI layer's unit tests: a character tokenizer, an engine that
answers at once, and the app over them (served through starlette's TestClient, no socket)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import jinja2
from fastapi.testclient import TestClient

from spyre_serve.server.engine.core import RequestRejected, SeqUpdate
from spyre_serve.server.launch.settings import Settings
from spyre_serve.server.openai.app import create_app
from spyre_serve.server.sched.sequence import TokenLogprob

# token i (1..) is ALPHABET[i - 1]; 0 is <eos>. After the letters, what a JSON tool call is written with.
ALPHABET = " abcdefghijklmnopqrstuvwxyz.,!?é" + '<>/{}":_\nB'

VOCAB = len(ALPHABET) + 1


class CharTokenizer:
    """One character per token; id 0 is the special ``<eos>``. The chat template writes
    ``<role>: <content>`` lines and ``assistant:`` when asked for the generation prompt."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([0] if add_special_tokens else []) + [ALPHABET.index(c) + 1 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(("" if skip_special_tokens else "<eos>") if i == 0 else ALPHABET[i - 1] for i in ids)

    # what the template reads, for the server's check of chat_template_kwargs; rendered below
    chat_template = ("{{ greeting }}{% for m in messages %}{{ m.role }}. {{ m.content }} {% endfor %}"
                     "{% if add_generation_prompt %}assistant.{% endif %}{% if fail %}{{ raise_exception(fail) }}"
                     "{% endif %}")

    def apply_chat_template(self, convo, add_generation_prompt: bool, tokenize: bool, **variables) -> str:
        if variables.get("fail"):
            raise jinja2.TemplateError(variables["fail"])
        greeting = [variables["greeting"]] if variables.get("greeting") else []
        lines = [f"{m['role']}. {m['content']}" for m in convo]
        return " ".join(greeting + lines + (["assistant."] if add_generation_prompt else []))


def ids_of(text: str) -> list[int]:
    return CharTokenizer().encode(text, add_special_tokens=False)


class ScriptedEngine:
    """Answers every choice with ``reply`` (cut to its max_tokens), one update per character
    (logprob -0.5, its next character as the one top alternative), as soon as it is added."""

    def __init__(self, reply: str = "ok.", max_model_len: int = 64) -> None:
        self.reply = reply
        self.max_model_len = max_model_len
        self.vocab_size = VOCAB
        self.eos_token_ids = ()
        self.numerics = "scripted"
        self.pooling = None          # a generating engine
        self.alive = True
        self.accepting = True
        self.error = None
        self.on_death = None
        self.num_requests = self.num_running_requests = self.num_waiting_requests = 0
        self.num_waiting_sequences = 0
        self.added: list = []  # (request_id, prompt ids, params)
        self.aborted: list[str] = []

    def check_request(self, num_prompt_tokens: int, max_tokens: int, params=None, prompt_ids=None) -> None:
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise RequestRejected(f"{num_prompt_tokens} + {max_tokens} > {self.max_model_len}", "max_tokens")

    def add_request(self, request_id: str, ids: list[int], params: list, on_update) -> None:
        self.added.append((request_id, ids, params))
        for j, p in enumerate(params):
            text = self.reply[:p.max_tokens]
            for k, ch in enumerate(text):
                t = ids_of(ch)
                lps = [TokenLogprob(t[0], -0.5, [(t[0] % (VOCAB - 1) + 1, -1.0)])] if p.logprobs is not None else []
                last = k == len(text) - 1
                on_update(SeqUpdate(index=j, text=ch, token_ids=t, logprobs=lps,
                                    finish_reason="length" if last else None))

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def lora_update(self, op: str, name: str, path: str | None):
        return 400, "LoRA is not enabled on this server (start it with --enable-lora)"

    def shutdown(self, timeout: float = 10.0) -> None:
        self.alive = self.accepting = False


class RecordingEngine:
    """Keeps each request's on_update for the test to call, from any thread."""

    def __init__(self) -> None:
        self.deliver: dict[str, object] = {}
        self.aborted: list[str] = []

    def add_request(self, request_id, ids, params, on_update) -> None:
        self.deliver[request_id] = on_update

    def abort(self, request_id) -> None:
        self.aborted.append(request_id)


def update(index: int, text: str, ids: list[int], finish: str | None = None, error: str | None = None) -> SeqUpdate:
    return SeqUpdate(index=index, text=text, token_ids=ids, logprobs=[], finish_reason=finish, error=error)


def fake_model(name: str = "tiny") -> SimpleNamespace:
    """What create_app reads of a loaded model."""
    return SimpleNamespace(name=name, path=Path("/models") / name, tokenizer=CharTokenizer(),
                           config=SimpleNamespace(vocab_size=VOCAB, hidden_size=16))


def client_for(engine=None, metrics=None, raise_server_exceptions=True, **settings) -> TestClient:
    """A client of the whole app over ``engine`` (a ScriptedEngine by default) and the fake
    model; with ``raise_server_exceptions=False`` it sees a failing handler's 500."""
    app = create_app(engine or ScriptedEngine(), fake_model(), Settings(**settings), metrics)
    return TestClient(app, raise_server_exceptions=raise_server_exceptions)
