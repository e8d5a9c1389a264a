"""The OpenAI API over the engine (vLLM's field set).

The endpoint families each have a package: ``generation/`` (/v1/completions, /v1/chat/completions,
and their prompts' token ids for routers: /v1/completions/render, /v1/chat/completions/render),
``responses/`` (/v1/responses), ``pooling/`` (/v1/embeddings, /score); LoRA's runtime routes are
``server.lora.api``. What every endpoint shares is here, one job per module:

- ``app``: ``create_app``, wiring the routers onto shared state;
- ``serving``: that shared state (the engine, as an ``EngineClient``; tokenizer, served name,
  limits) and the checks every endpoint makes before submitting; ``limits``: the caps on one
  request; ``fields``: the request fields' constraints, declared once;
- ``body``: reading a body within the size limit; ``openapi``: what /openapi.json declares;
- ``errors``: the OpenAI error shape and the app's exception handlers; ``auth``: the API key;
  ``request_id``: ``X-Request-Id``; ``request_counts``: requests answered, by endpoint and status;
- ``offload``: blocking work (templates, tokenizing) off the event loop, within a time bound;
- ``bridge``: engine thread -> event loop (``Submission``, ``collect``);
- ``tokenization`` (/tokenize, /detokenize), ``status`` (/v1/models, /health, /ping, /version,
  /metrics), ``fleet`` (what a router reads of a replica: model and server information, load).

Imports ``server.engine`` (the seams, its errors), ``server.sched.sequence``,
``server.structured_output``, ``server.lora`` and ``spyre_serve.models``' public names.
Imported by ``server.launch``.
"""
