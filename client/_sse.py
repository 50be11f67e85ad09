"""Server-Sent Events decoding for streamed generations (I/O-free, shared by both clients)."""

from __future__ import annotations

import json

from .errors import PolyserveError, error_from_payload
from .types import StreamChunk

DONE = object()
"""Sentinel returned by :func:`parse_sse_event` for ``data: [DONE]``."""


class SSEDecoder:
    """Incremental decoder of ``text/event-stream`` lines into event data strings.

    Follows the SSE framing rules that matter here: ``data:`` lines (one optional space after the
    colon) accumulate, joined by newlines, until a blank line ends the event; comments (``:``) and
    other fields (``event:``, ``id:``, ``retry:``) are ignored.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Consume one line (without its newline); return an event's data when one completes."""
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return None

    def flush(self) -> str | None:
        """End the current event (also call at end of stream)."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def parse_sse_event(data: str) -> StreamChunk | object:
    """Turn one event's data into a :class:`StreamChunk`, or :data:`DONE`; raise error events."""
    if data.strip() == "[DONE]":
        return DONE
    try:
        payload = json.loads(data)
    except ValueError as exc:
        raise PolyserveError(None, "invalid_response", "malformed stream event") from exc
    if isinstance(payload, dict) and "error" in payload and "text" not in payload:
        raise error_from_payload(None, payload)
    return StreamChunk.from_json(payload)


class ChunkParser:
    """Turns SSE lines into :class:`StreamChunk` objects; shared by the sync and async streams.

    ``feed`` returns the chunks a line completes; ``done`` turns true at ``data: [DONE]``.  ``close``
    (at the end of the byte stream) raises if the stream stopped before its final event.
    """

    def __init__(self) -> None:
        self._decoder = SSEDecoder()
        self.done = False
        self._finished = False

    def _event(self, data: str | None) -> list[StreamChunk]:
        if data is None or self.done:
            return []
        item = parse_sse_event(data)
        if item is DONE:
            self.done = True
            return []
        assert isinstance(item, StreamChunk)
        self._finished = self._finished or item.is_final
        return [item]

    def feed(self, line: str) -> list[StreamChunk]:
        return self._event(self._decoder.feed(line))

    def close(self) -> list[StreamChunk]:
        chunks = self._event(self._decoder.flush())
        if not (self.done or self._finished):
            raise PolyserveError(None, "incomplete_stream", "the stream ended before its final event")
        return chunks
