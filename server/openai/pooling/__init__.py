"""The pooling endpoints of an embedding model: /v1/embeddings (OpenAI's) and /score (vLLM's).

    api.py       the routes, served by a pooling runner (an encoder, or ``--runner pooling``)
    protocol.py  their request bodies

Imports ``server.openai.generation`` (prompts, protocol), the shared pieces of
``server.openai`` and ``spyre_serve.models``' SamplingParams. Imported by ``server.openai.app``.
"""
