"""Drive one HTTP request through an ASGI app in-process, counting the body chunks it reads."""

from __future__ import annotations

from typing import Any

__all__ = ["AsgiAnswer", "call_asgi"]

AsgiAnswer = tuple[int, dict[str, str], bytes, int]
"""(status, response headers, response body, request body chunks the app pulled)."""


async def call_asgi(
    app: Any, method: str, path: str, headers: dict[str, str], chunks: list[bytes]
) -> AsgiAnswer:
    """Run one request through ``app``, its body given as ``chunks``."""
    pulled = 0
    sent: list[dict[str, Any]] = []
    raw_path, _, query = path.partition("?")

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        if pulled < len(chunks):
            pulled += 1
            return {
                "type": "http.request",
                "body": chunks[pulled - 1],
                "more_body": pulled < len(chunks),
            }
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": raw_path,
        "raw_path": raw_path.encode(),
        "root_path": "",
        "query_string": query.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8080),
        "state": {},
    }
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    answer_headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], answer_headers, body, pulled
