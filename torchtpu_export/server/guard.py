"""What reaches the application: :class:`RequestGuard`, the ASGI middleware in front of KServe's
FastAPI application, checking every request's route, host, origin, content type and body size before any
route sees it."""
from __future__ import annotations

import json

# (methods, path) the server answers; everything else KServe's application has (model repository
# load/unload, v1 predict/explain, docs) is not served
_V2_ROUTES = [("GET", r"/v2"), ("GET", r"/v2/health/(live|ready)"), ("GET", r"/v2/models"),
              ("GET", r"/v2/models/[^/]+"), ("GET", r"/v2/models/[^/]+/ready"), ("POST", r"/v2/models/[^/]+/infer"),
              ("GET", r"/metrics")]
_OPENAI_ROUTES = [("POST", r"/v1/(chat/)?completions"), ("GET", r"/v1/models"), ("GET", r"/v1/models/[^/]+")]


class RequestGuard:
    """An ASGI middleware in front of KServe's application, checking what every request is before it
    reaches a route: one of the served routes (404 otherwise: no model-repository, v1 or docs routes),
    a Host that names this server (421: DNS rebinding), no browser Origin but the ones ``--allow-origin``
    names (403), a JSON body on POST (415; a v2 request with no content type is JSON, as tritonclient
    sends it, and binary tensors come with their header length), and a body no larger than ``limits``
    allows (413), read whole before the route sees it. Allowed origins get CORS headers."""

    def __init__(self, app, *, bound: str, openai: bool, body_limit: int, allow_origins=()):
        import re
        self.app, self.bound, self.body_limit, self.origins = app, bound, body_limit, tuple(allow_origins)
        routes = _V2_ROUTES + (_OPENAI_ROUTES if openai else [])
        self.routes = [(m, re.compile(p + "/?")) for m, p in routes]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from ..httpcheck import host_allowed, origin_allowed
        headers = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        method, path = scope["method"], scope["path"]
        origin = headers.get("origin")
        if not host_allowed(self.bound, headers.get("host")):
            return await _plain(send, 421, f"this server does not answer for host {headers.get('host', '')!r}")
        if not origin_allowed(origin, self.origins):
            return await _plain(send, 403, f"cross-site requests from {origin!r} are refused "
                                           "(start the server with --allow-origin ORIGIN to allow a web app)")
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")] if origin else []
        allowed = {m for m, rx in self.routes if rx.fullmatch(path)}
        if method == "OPTIONS" and origin and allowed:  # a preflight of an allowed origin
            return await _plain(send, 204, "", cors + [
                (b"access-control-allow-methods", ", ".join(sorted(allowed)).encode()),
                (b"access-control-allow-headers", b"content-type, authorization"),
                (b"access-control-max-age", b"600")])
        if not allowed:
            return await _plain(send, 404, f"no route {path!r} on this server")
        if method not in allowed and not (method == "HEAD" and "GET" in allowed):
            return await _plain(send, 405, f"{path} takes {', '.join(sorted(allowed))}, not {method}")
        if method == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            v2 = path.startswith("/v2/")
            if not ctype and v2 and "inference-header-content-length" not in headers:
                scope = dict(scope, headers=[*scope["headers"], (b"content-type", b"application/json")])
            elif ctype != "application/json" and not (v2 and ctype in ("", "application/octet-stream")
                                                     and "inference-header-content-length" in headers):
                return await _plain(send, 415, "send the request body as JSON (Content-Type: application/json)")
            body = await _read_body(receive, headers.get("content-length"), self.body_limit)
            if body is None:
                return await _plain(send, 413, f"the request body is over {self.body_limit:,} bytes, more than "
                                               "this model's requests can need")
            receive = _replay(body, receive)
        if cors:
            send = _with_headers(send, cors)
        return await self.app(scope, receive, send)


async def _read_body(receive, length: str | None, limit: int) -> bytes | None:
    """The whole request body, or None once it is past ``limit`` (its declared length or what came)."""
    if length is not None and (not length.isdigit() or int(length) > limit):
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    """``receive`` for the application: the body read already, then the connection's own messages (a
    streaming response waits on them to see the client go)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def _with_headers(send, extra):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = dict(message, headers=[*message.get("headers", []), *extra])
        await send(message)
    return wrapped


async def _plain(send, status: int, message: str, headers=()) -> None:
    body = json.dumps({"error": message}).encode() if status != 204 else b""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
