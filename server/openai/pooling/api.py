"""``POST /v1/embeddings`` (OpenAI's) and ``POST /score`` and ``/v1/score`` (vLLM's), served by
a pooling runner (``--runner pooling``, or an encoder checkpoint: ``models/build.py``).

Each input is tokenized as a completion's prompt (special tokens added unless
``add_special_tokens`` is false), checked to fit the context, and submitted as a request that
samples nothing (``GenerationParams.pooling``, ``max_tokens`` 0): the engine batches embedding
requests continuously like prefills, and each comes back as its whole prompt's pooled vector
(``SeqUpdate.embedding``). ``/score`` embeds ``text_1`` and ``text_2`` in one submission and
answers the cosine of each pair (one against many, or pairwise), as vLLM does for an embedding
model.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from spyre_serve.models import SamplingParams
from spyre_serve.server.openai.bridge import collect, spyre_usage
from spyre_serve.server.openai.errors import APIError, internal_error
from spyre_serve.server.openai.generation.prompts import completion_prompts
from spyre_serve.server.openai.generation.reply import CLIENT_CLOSED
from spyre_serve.server.openai.limits import check_priority
from spyre_serve.server.openai.openapi import GENERATION_ERRORS, route
from spyre_serve.server.openai.pooling.protocol import (
    EmbeddingRequest,
    PoolingRequest,
    ScoreRequest,
)
from spyre_serve.server.openai.request_id import request_ids
from spyre_serve.server.openai.serving import Serving, serving_of
from spyre_serve.server.sched.sequence import GenerationParams

router = APIRouter()


@router.post("/v1/embeddings", **route(EmbeddingRequest, GENERATION_ERRORS))
async def create_embedding(request: Request):
    def answer(req: EmbeddingRequest, vectors: list[np.ndarray], normalize: bool) -> list[dict]:
        return [{"object": "embedding", "index": i,
                 "embedding": encoded(v, req.dimensions, req.encoding_format, normalize)}
                for i, v in enumerate(vectors)]

    return await pooling_answer(request, "embd", EmbeddingRequest, lambda req: [(req.input, "input")], answer)


@router.post("/score", **route(ScoreRequest, GENERATION_ERRORS))
@router.post("/v1/score", **route(ScoreRequest, GENERATION_ERRORS))
async def create_score(request: Request):
    def texts(req: ScoreRequest) -> list[tuple]:
        return [([side] if isinstance(side, str) else side, name)
                for side, name in ((req.text_1, "text_1"), (req.text_2, "text_2"))]

    def answer(req: ScoreRequest, vectors: list[np.ndarray], _normalize: bool) -> list[dict]:
        n1 = 1 if isinstance(req.text_1, str) else len(req.text_1)
        a, b = vectors[:n1], vectors[n1:]
        pairs = [(0, j) for j in range(len(b))] if n1 == 1 else [(i, i) for i in range(n1)]
        return [{"index": k, "object": "score", "score": cosine(a[i], b[j])} for k, (i, j) in enumerate(pairs)]

    return await pooling_answer(request, "score", ScoreRequest, texts, answer)


async def pooling_answer(request: Request, prefix: str, body: type[PoolingRequest],
                         inputs_of: Callable, data_of: Callable) -> Response:
    """The steps both endpoints share: ids, admission, the body (``body``), its inputs
    (``inputs_of(req)``: (inputs, field) pairs) embedded, and the list body of ``data_of(req,
    vectors, whether the model normalizes)`` with the usage."""
    serving = serving_of(request)
    response_id, engine_id = request_ids(request, prefix)
    serving.check_admission(1)
    req = await serving.read(request, body)
    if isinstance(req, EmbeddingRequest):
        check_dimensions(req.dimensions, serving.hidden_size, matryoshka(serving.model_root))
    normalize = serving.engine.pooling is not None and serving.engine.pooling[1]
    vectors = await embed(serving, request, engine_id, req, inputs_of(req))
    if isinstance(vectors, Response):
        return vectors
    vectors, tokens, projected = vectors
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    if isinstance(req, ScoreRequest):
        usage["completion_tokens"] = 0             # vLLM's score usage has it
    if projected:                                  # the steps on a real card, as a generation's
        usage["spyre"] = spyre_usage(projected)
    data = data_of(req, vectors, normalize)
    return JSONResponse({"id": response_id, "object": "list", "created": int(time.time()),
                         "model": serving.model_name, "data": data, "usage": usage})


async def embed(serving: Serving, request: Request, engine_id: str, req: PoolingRequest,
                groups: list[tuple]) -> tuple[list[np.ndarray], int, list] | Response:
    """Each input's pooled vector, the request's prompt tokens and the inputs' projected times
    on a real card (those the runner projects), or the response to give instead (499: the
    client left first). ``groups``: (inputs, the field they came from); an input over a cap or
    the context is a 400 naming its field."""
    check_priority(req.priority, serving.settings)
    cap, keep = serving.settings, keep_tokens(req.truncate_prompt_tokens, serving.engine.max_model_len)
    params = [GenerationParams(SamplingParams(), max_tokens=0, pooling=True, priority=req.priority)]
    prompts: list[list[int]] = []
    for inputs, param in groups:
        count = 1 if isinstance(inputs, str) or isinstance(inputs[0], int) else len(inputs)
        if count > cap.max_prompts:
            raise APIError(400, f"{param} holds {count} inputs, the limit is {cap.max_prompts} (--max-prompts)", param)
        texts = [inputs] if isinstance(inputs, str) else [t for t in inputs if isinstance(t, str)]
        serving.check_text_fits(texts, param, req.truncate_prompt_tokens)
        ids = await serving.prompt_ids("tokenizing the input", param, embedding_prompts, serving.tokenizer,
                                       inputs, req.add_special_tokens, keep, truncate=None)
        for one in ids:
            serving.check_fits(one, params, {"prompt": param})
        prompts += ids
    if len(prompts) > cap.max_waiting:
        raise APIError(400, f"this request has {len(prompts)} inputs, more than the {cap.max_waiting} sequences "
                            f"the waiting queue holds (--max-waiting)", groups[-1][1])
    sub = serving.start(engine_id, prompts, params, renames={"prompt": groups[0][1]})
    await collect(sub, request.is_disconnected)
    if not sub.done:
        return Response(status_code=CLIENT_CLOSED)
    if sub.error:
        raise internal_error(sub.error, sub.request_id)
    projected = [c.projected for c in sub.choices if c.projected is not None]
    return [c.embedding for c in sub.choices], sum(map(len, prompts)), projected


def keep_tokens(truncate: int | None, max_model_len: int) -> int | None:
    """The tokens ``truncate_prompt_tokens`` keeps of an input (-1: the context), or None; a
    400 when it is over the context."""
    if truncate is None:
        return None
    if truncate > max_model_len:
        raise APIError(400, f"truncate_prompt_tokens ({truncate}) is over this model's context length "
                            f"({max_model_len})", "truncate_prompt_tokens")
    return max_model_len if truncate == -1 else truncate


def embedding_prompts(tokenizer, inputs, add_special_tokens: bool, keep: int | None) -> list[list[int]]:
    """One token-id list per input; with ``keep``, a text is cut by the tokenizer itself, its
    special tokens kept (an encoder's <s> is what CLS pooling reads; vLLM tokenizes with
    truncation=True, max_length=keep), and token ids keep their last ``keep``."""
    if keep is None:
        return completion_prompts(tokenizer, inputs, add_special_tokens)
    texts = [inputs] if isinstance(inputs, str) else inputs
    if texts and all(isinstance(t, str) for t in texts):
        return [tokenizer(t, add_special_tokens=add_special_tokens, truncation=True, max_length=keep)["input_ids"]
                for t in texts]
    return [ids[-keep:] for ids in completion_prompts(tokenizer, inputs, add_special_tokens)]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine of two vectors (0 when either is zero)."""
    norm = float(np.linalg.norm(a)) * float(np.linalg.norm(b))
    return float(np.dot(a.astype(np.float64), b.astype(np.float64)) / norm) if norm else 0.0


@cache
def matryoshka(model_root: str) -> tuple[int, ...] | None:
    """The dimensions a Matryoshka model's embeddings may be cut to (config.json's
    ``matryoshka_dimensions``, or any with ``is_matryoshka``: vLLM's fields); None for a model
    that is not one."""
    try:
        config = json.loads((Path(model_root) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        return tuple(int(d) for d in dims)
    return () if config.get("is_matryoshka") else None


def check_dimensions(dimensions: int | None, hidden: int, allowed: tuple[int, ...] | None) -> None:
    """400 naming ``dimensions`` unless the model's embeddings may be cut to that many, as vLLM
    allows: a Matryoshka model's listed sizes (``matryoshka_dimensions``), any size up to its
    width with ``is_matryoshka`` alone; none for another model."""
    if dimensions is None:
        return
    if allowed is None:
        raise APIError(400, f"dimensions {dimensions}: this model is not a Matryoshka model (its config.json names "
                            f"no matryoshka_dimensions): its embeddings have {hidden} dimensions", "dimensions")
    if allowed and dimensions not in allowed:
        raise APIError(400, f"dimensions {dimensions}: this Matryoshka model's embeddings may have "
                            f"{', '.join(map(str, allowed))} dimensions", "dimensions")
    if not 1 <= dimensions <= hidden:
        raise APIError(400, f"dimensions {dimensions}: this Matryoshka model's embeddings may have 1 to {hidden} "
                            f"dimensions", "dimensions")


def encoded(vector: np.ndarray, dimensions: int | None, encoding_format: str, normalize: bool) -> list[float] | str:
    """One embedding as the client asked: cut to ``dimensions`` (then unit length again when the
    model's pooling normalizes, as vLLM does), as floats or base64 of its float32 bytes
    (little-endian, OpenAI's)."""
    v = vector.astype(np.float32)
    if dimensions is not None and dimensions < len(v):
        v = v[:dimensions]
        norm = float(np.linalg.norm(v))
        v = v / norm if norm and normalize else v
    if encoding_format == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return v.tolist()
