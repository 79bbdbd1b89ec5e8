"""What both HTTP servers (``serve`` and ``serve-web``) check of a request before anything else:
that its Host names this server (a page whose DNS name was rebound to 127.0.0.1 names its own
host) and that a browser's cross-site request comes from an origin the user allowed."""
from __future__ import annotations

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def host_allowed(bound: str, host: str | None) -> bool:
    """Whether a request's Host header names a server bound to ``bound``: its address or localhost
    (any Host when bound to every interface, which the user asked for with --host)."""
    if bound in ("0.0.0.0", "::", ""):
        return True
    if not host:
        return False
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return name.strip("[]").lower() in LOOPBACK_NAMES | {bound.lower()}


def origin_allowed(origin: str | None, allowed) -> bool:
    """Whether a request may go on: no Origin header (not a browser's cross-site request), or one
    of ``allowed`` (``*`` allows any)."""
    return origin is None or "*" in allowed or origin.rstrip("/").lower() in {a.rstrip("/").lower() for a in allowed}
