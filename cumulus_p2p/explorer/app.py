"""The explorer's ASGI application: five pages, a JSON API under ``/api/``, live events.

Read-only by construction: every route is a GET, nothing in a request reaches the
node. Only the host names the explorer is served on are answered (``TrustedHostMiddleware``):
a page on another site that rebinds its own name to this machine's address (DNS rebinding)
sends its own name as ``Host`` and is refused, so it cannot read the ledger, the leases or
the peers. The pages are empty shells; ``static/explorer.js`` fills them from the API with
``textContent``, never HTML, because every string in the data came from untrusted
gossip. The Content-Security-Policy allows scripts, styles and connections to this
origin only, so even markup that slipped into a page could not run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import anyio
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..node.datadir import DataDir
from . import model
from .history import History

HERE = Path(__file__).parent
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGES = {"/": "hosts", "/book": "book", "/leases": "leases", "/mesh": "mesh"}
#: Seconds between keep-alive comments on an idle event stream.
KEEPALIVE_S = 15.0


class StateSource:
    """The node's state as the explorer sees it: re-read from the data directory, with
    each host's history, and an event for whoever waits for the next change."""

    def __init__(self, data: DataDir) -> None:
        self.data = data
        self.state: dict = {}
        self.history = History()
        self.version = 0
        self._changed = anyio.Event()

    def refresh(self, now: float | None = None) -> bool:
        """Read ``state.json`` again; True (and listeners woken) if the node rewrote it."""
        state = self.data.read_state()
        if state is None or state.get("updated") == self.state.get("updated"):
            return False
        self.state = state
        self.history.record(state, time.time() if now is None else now)
        self.version += 1
        self._changed.set()
        self._changed = anyio.Event()
        return True

    async def next_change(self, seen: int) -> int:
        """Wait until the version passes ``seen``; returns the new version."""
        while self.version <= seen:
            await self._changed.wait()
        return self.version

    def status(self) -> dict:
        state = self.state
        return {
            "peer_id": state.get("peer_id", ""),
            "role": state.get("role", "bootstrap" if state else ""),
            "running": self.data.is_locked(),
            "updated": state.get("updated"),
            "version": self.version,
        }


def build_app(source: StateSource, hosts: Sequence[str]) -> Starlette:
    """The explorer for ``source``, answering requests whose ``Host`` is one of ``hosts``.

    Args:
        source: The node's state.
        hosts: Host names and addresses as a ``Host`` header carries them (IPv6 in
            brackets), without the port; any other host gets a 400.
    """
    templates = Environment(
        loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"])
    )

    def page(name: str, **context) -> HTMLResponse:
        html = templates.get_template("page.html").render(page=name, **context)
        return HTMLResponse(html)

    async def show_page(request: Request) -> Response:
        return page(PAGES[request.url.path])

    async def show_host(request: Request) -> Response:
        return page("host", peer=request.path_params["peer"])

    def api(build):
        async def endpoint(request: Request) -> Response:
            return JSONResponse(build(request))

        return endpoint

    async def one_host(request: Request) -> Response:
        entries = source.data.ledger().entries()
        found = model.host(source.state, request.path_params["peer"], source.history, entries)
        if found is None:
            return JSONResponse({"error": "no such host"}, status_code=404)
        return JSONResponse(found)

    def leases(request: Request) -> dict:
        return model.leases(source.state, source.data.ledger().entries())

    async def events(request: Request) -> Response:
        headers = {"Cache-Control": "no-store"}
        return StreamingResponse(_stream(source), media_type="text/event-stream", headers=headers)

    routes = [
        *(Route(path, show_page) for path in PAGES),
        Route("/hosts/{peer}", show_host),
        Route("/api/status", api(lambda r: source.status())),
        Route("/api/hosts", api(lambda r: model.hosts(source.state, source.history))),
        Route("/api/hosts/{peer}", one_host),
        Route("/api/book", api(lambda r: model.book(source.state))),
        Route("/api/leases", api(leases)),
        Route("/api/peers", api(lambda r: model.peers(source.state))),
        Route("/api/mesh", api(lambda r: model.mesh(source.state))),
        Route("/api/events", events),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    middleware = [
        Middleware(_SecurityHeaders),
        Middleware(TrustedHostMiddleware, allowed_hosts=list(hosts), www_redirect=False),
    ]
    return Starlette(routes=routes, middleware=middleware)


async def _stream(source: StateSource):
    """Server-sent events: the state's version each time it changes."""
    seen = source.version
    yield f"data: {seen}\n\n"
    while True:
        changed = None
        with anyio.move_on_after(KEEPALIVE_S):  # never yield inside the scope
            changed = await source.next_change(seen)
        if changed is None:
            yield ": keep-alive\n\n"
        else:
            seen = changed
            yield f"data: {seen}\n\n"


_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]


class _SecurityHeaders:
    """Adds the security headers to every response (plain ASGI, so streams stream)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)
