"""The OpenAI API over the engine (vLLM's field set), one job per module:

- ``app``: ``create_app``, wiring the routers below onto shared state;
- ``serving``: that shared state (engine, tokenizer, served name, limits) and the checks
  every endpoint makes before submitting; ``limits``: the caps on one request;
- ``protocol``: the request bodies (pydantic); ``body``: reading one within the size limit;
  ``openapi``: what /openapi.json declares of them;
- ``errors``: the OpenAI error shape and the app's exception handlers; ``auth``: the API key;
  ``request_id``: ``X-Request-Id``, taken as the request's id and sent back;
- ``prompts``: prompts and chat messages as token ids; ``offload``: that work off the event
  loop, within a time bound; ``sampling``: request fields as the engine's ``GenerationParams``;
- ``bridge``: engine thread -> event loop (``Submission``, ``collect``);
- ``response``: one JSON body or a stream; ``sse``: the stream's events;
  ``logprobs``: logprobs as each API writes them;
- endpoints: ``completions``, ``chat``, ``responses_api`` (/v1/responses, made as a chat:
  ``responses_request`` its body, ``responses_output`` the response and its events,
  ``responses_store`` the stored ones), ``tokenization`` (/tokenize, /detokenize),
  ``status`` (/v1/models, /health, /ping, /version, /metrics).
"""
