"""The caps on one request, from the server's settings, checked before any work is done.

A body under ``--max-body-bytes`` can still ask for a lot: hundreds of thousands of
one-token prompts, each with ``n`` choices; stop strings searched on the engine thread
after every token, as many and as long as the client likes. So each is capped (vLLM has
no such caps; the defaults are set well above what real clients send): the prompts of a
completion (``--max-prompts``), ``n`` (``--max-n``), the stop strings' count and length
(``--max-stop-strings``, ``--max-stop-length``), ``stop_token_ids`` (``--max-stop-token-ids``),
the request's sequences (prompts x n): more than the waiting queue holds (``--max-waiting``)
could never be admitted; and what costs work that grows with its size before the engine
sees it: each JSON schema of structured output (``--max-schema-bytes``), the tools of a chat
(``--max-tools``, ``--max-tools-bytes``; their checks and grammars then run on a worker
thread, ``structured``). Each refusal is a 400 naming the limit's flag.
Whether the queue has room now is the 503 of ``Serving.check_admission``.
"""

from __future__ import annotations

from spyre_serve.server.launch.settings import Settings
from spyre_serve.server.openai.errors import APIError, json_head
from spyre_serve.server.openai.generation.protocol import CompletionRequest, SamplingRequest


def num_prompts(req: SamplingRequest) -> int:
    """How many prompts the request holds: a completion's list of strings or of token-id
    lists is one per item; a string, a token-id list or a chat is one."""
    prompt = req.prompt if isinstance(req, CompletionRequest) else None
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def json_over(value, limit: int) -> bool:
    """Whether ``value`` takes more than ``limit`` characters as JSON (a string: its own
    length); encoded only as far as the limit, so the answer costs at most that much."""
    if isinstance(value, str):
        return len(value) > limit
    head = json_head(value, limit)
    return head is not None and len(head) > limit   # not JSON-encodable: its own check refuses it


def schemas_of(req: SamplingRequest) -> list[tuple[str, object]]:
    """(field, the JSON schema it gives) of each structured-output field holding one."""
    out = []
    rf = req.response_format if isinstance(req.response_format, dict) else {}
    js = rf.get("json_schema")
    if isinstance(js, dict) and "schema" in js:
        out.append(("response_format", js["schema"]))
    so = req.structured_outputs if isinstance(req.structured_outputs, dict) else {}
    if so.get("json") is not None:
        out.append(("structured_outputs", so["json"]))
    if req.guided_json is not None:
        out.append(("guided_json", req.guided_json))
    return out


def check_schema_size(schema, param: str, s: Settings) -> None:
    """400 naming ``param`` for a JSON schema over ``--max-schema-bytes``."""
    if json_over(schema, s.max_schema_bytes):
        raise APIError(400, f"{param}: the JSON schema is over {s.max_schema_bytes} bytes "
                            f"(--max-schema-bytes)", param)


def check_sizes(req: SamplingRequest, s: Settings) -> None:
    """400 for a JSON schema or a tools list over its cap."""
    for param, schema in schemas_of(req):
        check_schema_size(schema, param, s)
    tools = req.tools or []
    if len(tools) > s.max_tools:
        raise APIError(400, f"tools lists {len(tools)} functions, the limit is {s.max_tools} (--max-tools)", "tools")
    if json_over(tools, s.max_tools_bytes):
        raise APIError(400, f"tools is over {s.max_tools_bytes} bytes as JSON (--max-tools-bytes)", "tools")


def check_priority(priority: int, s: Settings) -> None:
    """400 for a priority other than 0 under fcfs scheduling (vLLM refuses it so too)."""
    if priority and s.scheduling_policy != "priority":
        raise APIError(400, f"priority {priority} asks for priority scheduling, which this server "
                            f"does not do (--scheduling-policy {s.scheduling_policy})", "priority")


def check_limits(req: SamplingRequest, prompts: int, settings: Settings) -> None:
    """400 for the first cap ``req`` (with ``prompts`` prompts) goes over."""
    s = settings
    if prompts > s.max_prompts:
        raise APIError(400, f"prompt is a list of {prompts} prompts, the limit is {s.max_prompts} (--max-prompts)",
                       "prompt")
    if req.n > s.max_n:
        raise APIError(400, f"n must be at most {s.max_n}, got {req.n}", "n")
    stop = req.stop or []
    if len(stop) > s.max_stop_strings:
        raise APIError(400, f"stop has {len(stop)} strings, the limit is {s.max_stop_strings} "
                            f"(--max-stop-strings)", "stop")
    for i, text in enumerate(stop):
        if len(text) > s.max_stop_length:
            raise APIError(400, f"stop string {i} is {len(text)} characters long, the limit is "
                                f"{s.max_stop_length} (--max-stop-length)", "stop")
    check_priority(req.priority, s)
    ids = req.stop_token_ids or []
    if len(ids) > s.max_stop_token_ids:
        raise APIError(400, f"stop_token_ids has {len(ids)} ids, the limit is {s.max_stop_token_ids} "
                            f"(--max-stop-token-ids)", "stop_token_ids")
    check_sizes(req, s)
    sequences = prompts * req.n
    if sequences > s.max_waiting:
        raise APIError(400, f"this request asks for {sequences} sequences ({prompts} prompts x n = {req.n}), "
                            f"more than the {s.max_waiting} the waiting queue holds (--max-waiting)", "n")
