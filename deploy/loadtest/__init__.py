"""`spyre-loadtest`: a load-test client for any OpenAI-compatible server.

Streaming /v1/completions or /v1/chat/completions, at a fixed concurrency or
a request rate with gamma arrivals, over random token-id prompts or text
prompts from a file; reports as `vllm bench serve` does. One idea per file:

- ``datasets``: the prompts;  ``arrivals``: when each is sent;
- ``client``: one streaming request, timed chunk by chunk;
- ``runner``: one load point, bounded in requests and time;
- ``stats``: the figures (TTFT, TPOT, ITL, E2EL, goodput);
- ``report``: vLLM's text layout;  ``plot``: the sweep as a PNG;
- ``cli``: the command.
"""
