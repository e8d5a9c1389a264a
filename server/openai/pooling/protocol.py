"""The bodies of the pooling endpoints (an embedding model's): OpenAI's ``/v1/embeddings`` and
vLLM's ``/score``, validated with pydantic as protocol.py's are (a field not declared here is a
400 naming it)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import field_validator, model_validator

from spyre_serve.server.openai.fields import Integer, TokenId, integer_at_least, schema, served
from spyre_serve.server.openai.generation.protocol import (
    FAIL_FAST,
    RequestModel,
    not_empty,
    truncate_prompt_tokens,
)

Texts = str | Annotated[list[str], schema(minItems=1, **served(maxItems="max_prompts")), FAIL_FAST]


class PoolingRequest(RequestModel):
    """What both endpoints share (vLLM's fields beside OpenAI's)."""

    task: ClassVar[str] = "pooling"      # served by a pooling runner only (Serving.read)
    model: str | None = None
    truncate_prompt_tokens: Annotated[Integer | None, schema(minimum=-1)] = None
    add_special_tokens: bool = True      # the tokenizer's <s> ... </s> (or BOS) around a text
    priority: Integer = 0                # vLLM's: lower runs first (--scheduling-policy priority)
    user: str | None = None              # OpenAI's end-user id: no effect

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v):
        return truncate_prompt_tokens(v)


class EmbeddingRequest(PoolingRequest):
    input: Texts | Annotated[list[TokenId], schema(minItems=1), FAIL_FAST] \
        | Annotated[list[Annotated[list[TokenId], schema(minItems=1), FAIL_FAST]],
                    schema(minItems=1, **served(maxItems="max_prompts")), FAIL_FAST]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: integer_at_least(1) | None = None

    @field_validator("input")
    @classmethod
    def _input(cls, v, info):
        return not_empty(v, info)


class ScoreRequest(PoolingRequest):
    """vLLM's ``/score``: ``text_1`` against ``text_2``: one against one, one against many, or
    pairwise (equal lengths)."""

    text_1: Texts
    text_2: Texts
    encoding_format: Literal["float"] = "float"

    @model_validator(mode="after")
    def _pairs(self):
        n1 = 1 if isinstance(self.text_1, str) else len(self.text_1)
        n2 = 1 if isinstance(self.text_2, str) else len(self.text_2)
        if n1 > 1 and n1 != n2:
            raise ValueError(f"text_1 holds {n1} texts and text_2 {n2}: give one text_1, or as many "
                             f"as text_2 (scored pairwise)")
        return self
