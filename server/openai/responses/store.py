"""The Responses API's stored responses: what ``GET /v1/responses/{id}`` returns and what
``previous_response_id`` goes on from.

A response made with ``store: true`` (OpenAI's default) is kept when it is done, with the
conversation it ends as chat messages (the previous response's, its input's, its output's:
not its ``instructions``, which OpenAI does not carry over), so that the next request's
prompt starts with them. At most ``--max-stored-responses`` are kept, in this API process's
memory: a new one past that drops the oldest (with ``--api-server-count`` above 1 each
process keeps its own). Ids are the server's own and random (``request_id.request_ids``): two
requests are never kept under one id. Everything here runs on the event loop.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from spyre_serve.server.openai.errors import APIError


@dataclass(frozen=True, slots=True)
class Stored:
    body: dict            # the response object, as it was answered
    messages: list[dict]  # the conversation it ends, as chat messages (ChatMessage's fields)


class ResponseStore:
    """At most ``capacity`` responses by id, the oldest dropped first; 0 keeps none."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"--max-stored-responses must be 0 or more, got {capacity}")
        self.capacity = capacity
        self._kept: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response_id: str, stored: Stored) -> None:
        """Keep ``stored`` under ``response_id`` (replacing one kept under it), then drop the
        oldest past the capacity."""
        self._kept.pop(response_id, None)
        self._kept[response_id] = stored
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def get(self, response_id: str, param: str) -> Stored:
        """The response kept under ``response_id``; a 404 naming ``param`` (the field or the
        path parameter that gave the id) when none is."""
        stored = self._kept.get(response_id)
        if stored is None:
            raise APIError(404, f"no response with id {json.dumps(response_id)[:300]} is stored here: it was "
                                f"made with store: false, by another server, or dropped for newer ones (this "
                                f"server keeps the last {self.capacity}, --max-stored-responses)", param)
        return stored
