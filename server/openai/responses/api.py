"""``POST /v1/responses`` (OpenAI's Responses API, as ``client.responses.create`` calls it) and
``GET /v1/responses/{response_id}``.

A response is made as a chat (``chat.start_chat``): the body (``responses_request``) becomes a
chat request whose messages go through the same template, tool parsing, structured output,
sampling parameters and engine as ``/v1/chat/completions``; the errors name the Responses
API's fields (``input``, ``max_output_tokens``, ``text.format``). The answer is one response
object or a stream of its events (``responses_output``). A response made with ``store: true``
(the default) is kept (``responses_store``): ``GET`` returns it, and a later request's
``previous_response_id`` goes on from its conversation (404 for an id not kept). Its id is the
server's own, ``resp_`` and 48 random hex digits, whatever ``X-Request-Id`` says.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from spyre_serve.server.openai.errors import APIError
from spyre_serve.server.openai.generation.chat import start_chat
from spyre_serve.server.openai.generation.reply import encoded, full_response
from spyre_serve.server.openai.generation.response_bodies import (
    GENERATION_RESPONSES,
    ResponsesResponse,
)
from spyre_serve.server.openai.generation.sse import MEDIA_TYPE, event_stream
from spyre_serve.server.openai.openapi import GENERATION_ERRORS, REF, errors, route
from spyre_serve.server.openai.request_id import request_ids
from spyre_serve.server.openai.responses.output import Answer, ResponseEvents, output_items
from spyre_serve.server.openai.responses.request import ResponsesRequest, as_chat, text_format
from spyre_serve.server.openai.serving import serving_of

router = APIRouter()
CREATE = route(ResponsesRequest, GENERATION_ERRORS, streams=True, answers=GENERATION_RESPONSES["responses"])
CREATE["responses"][200]["description"] = ("the response; with `stream`, server-sent events (`event: <type>`, its data "
                                            "one event), the last `response.completed` or `response.incomplete`")
CREATE["responses"][404] = {**CREATE["responses"][404], "description": "`model` names a model this server does not "
                            "serve, or `previous_response_id` a response it does not keep"}
# the path parameter declared here (not as the handler's argument: FastAPI would add a 422 that never comes)
RETRIEVE = {"responses": {200: {"description": "the stored response", "content": {"application/json": {
                              "schema": {"$ref": REF.format(model=ResponsesResponse.__name__)}}}},
                          **errors(400, 401, 500), 404: {**errors(404)[404], "description": "no response with this id "
                                                         "is kept (store: false, dropped, or another server)"}},
            "openapi_extra": {"parameters": [{"name": "response_id", "in": "path", "required": True,
                                              "schema": {"type": "string"}}]}}


@router.post("/v1/responses", **CREATE)
async def create_response(request: Request):
    serving = serving_of(request)
    response_id, engine_id = request_ids(request, "resp", "_", server_made=True)   # the store's key: never a header
    serving.check_admission(1)          # before the body is read: a full queue costs nothing
    req = await serving.read(request, ResponsesRequest)
    history = [] if req.previous_response_id is None else \
        serving.responses.get(req.previous_response_id, "previous_response_id").messages
    chat, turns = as_chat(req, history)
    answer = Answer.of(response_id, req, serving.answered_as(req.model), serving.defaults, serving.responses,
                       history + turns)
    try:
        sub, tools = await start_chat(serving, chat, engine_id, "input", "max_output_tokens",
                                      text_format(req, serving.settings))
    except APIError as exc:
        if exc.param == "messages":     # the chat template's refusal (prompts.chat_prompt)
            exc.param = "input"
        raise
    [choice] = sub.choices
    if req.stream:
        events = ResponseEvents(answer, tools)
        stream = event_stream(sub, events.opening(), events.events,
                              lambda: events.closing(choice.finish_reason, sub.usage()), events.failed)
        return StreamingResponse(stream, media_type=MEDIA_TYPE)
    done = await full_response(sub, request.is_disconnected, {}, lambda _idx, c: c)
    if isinstance(done, Response):
        return done
    return encoded(answer.finish(output_items(tools, choice.text, choice.finish_reason), choice.finish_reason,
                                 done["usage"]))


@router.get("/v1/responses/{response_id}", **RETRIEVE)
async def retrieve_response(request: Request):
    """A stored response, as it was answered; a query parameter (OpenAI's ``stream``,
    ``include``, ``starting_after``: not served here) is a 400 naming it."""
    if request.query_params:
        name = next(iter(request.query_params))[:100]
        raise APIError(400, f"GET /v1/responses/{{response_id}} takes no query parameter here, got {name!r}", name)
    return encoded(serving_of(request).responses.get(request.path_params["response_id"], "response_id").body)
