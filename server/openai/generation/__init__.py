"""The generating endpoints: /v1/completions and /v1/chat/completions, and what they share.

    completions.py    POST /v1/completions
    chat.py           POST /v1/chat/completions
    render.py         POST /v1/completions/render, /v1/chat/completions/render: the prompts' token ids
    protocol.py       the request bodies (pydantic; vLLM's field set)
    response_bodies.py  the response bodies, as pydantic models (for /openapi.json and tests)
    prompts.py        a request's prompt or messages as token ids (BOS as vLLM, chat templates)
    sampling.py       the sampling fields as the engine's GenerationParams, one per choice
    tools.py          tool calls: the tools into the template, the model's calls out
    logprobs.py       logprobs as each API writes them
    reply.py          one JSON body when every choice is done, or a stream
    sse.py            Server-Sent Events: the framing and the streams

Imports ``server.openai``'s shared pieces (serving, bridge, errors, fields, body),
``server.structured_output`` and ``server.sched.sequence`` (GenerationParams). Imported by
``server.openai.app``, ``server.openai.responses`` (a response is made as a chat) and
``server.openai.pooling`` (prompts, protocol).
"""
