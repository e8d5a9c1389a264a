"""OpenAI's Responses API (``client.responses.create``): POST /v1/responses, made as a chat.

    api.py      the routes: POST /v1/responses, GET and DELETE /v1/responses/{id}
    request.py  its body, validated, and the chat it becomes
    output.py   the response object, its output items, and a stream's events
    store.py    the stored responses (``store``, ``previous_response_id``)

Imports ``server.openai.generation`` and ``server.openai``'s shared pieces. Imported by
``server.openai.app``.
"""
