"""``unicron coordinator``: the cluster service, an HTTP/JSON API (FastAPI on uvicorn).

Users (``unicron submit|status|cancel|logs``, :mod:`unicron.control.client`) and agents
(:mod:`unicron.control.node`) talk to it; every request carries the cluster's token
(``Authorization: Bearer TOKEN``) and one without it, or with a wrong one, gets 401 and a
log line, never data. The OpenAPI schema is served at ``/openapi.json``.

========================================  ==================================================
``POST /v1/tasks``                        submit a task (``unicron.control.taskspec.TaskSpec``)
``GET /v1/tasks``, ``GET /v1/tasks/{n}``  list, show
``POST /v1/tasks/{n}/cancel``             cancel
``GET /v1/tasks/{n}/events?after=ID``     the task's event log from ``after`` on
``GET /v1/nodes``                         nodes and their slots
``GET /metrics``                          Prometheus text format
``GET /v1/dashboard``                     the web dashboard's snapshot (:mod:`.dashboard`)
``GET /ui/``                              the web dashboard's page (static files, no data)
``POST /v1/agents/register``              an agent starts or reconnects
``POST /v1/agents/{node}/heartbeat``      an agent is alive; answers its assignments
``POST /v1/agents/{node}/tasks/{uid}/exchange``  one round of a task's supervisor
========================================  ==================================================

Errors are 4xx with ``{"detail": "one line"}``: 404 unknown task or node, 409 a conflict
with the cluster's state, 422 a body that is not valid (FastAPI names the field).

The dashboard's page and scripts under ``/ui/`` are the only paths served without the token:
they are the same files for everyone and hold no data. The page asks for the token, keeps it
in the tab's ``sessionStorage`` and sends it as the bearer header of its ``fetch`` calls
(never in a URL); see docs/cluster.md, "Dashboard".
"""

from __future__ import annotations

import argparse
import gc
import logging
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from unicron.control import messages as M
from unicron.control.client import ENV_TOKEN, resolve_token
from unicron.control.cluster import Cluster, Conflict, Invalid, NotFound
from unicron.control.taskspec import NAME, TaskSpec
from unicron.errors import UsageError

if TYPE_CHECKING:
    import uvicorn
    from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("unicron.control.service")

DEFAULT_PORT = 29400


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument(
        "--advertise",
        metavar="ADDR",
        help="address agents and workers reach this host at (default: --host; required with "
        "--host 0.0.0.0)",
    )
    p.add_argument("--state-dir", required=True, metavar="DIR", help="where the state lives")
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help=f"the token (else ${ENV_TOKEN}; else DIR/token, created on first start)",
    )
    p.add_argument(
        "--node-timeout",
        type=float,
        default=2.0,
        metavar="S",
        help="a node silent this long is lost (default 2)",
    )
    p.add_argument(  # baselines for bench/simreal.py (docs/cluster.md, placement)
        "--placement",
        choices=("planner", "keep", "equal"),
        default="planner",
        help="who sets each task's worker count: the planner (default), or a baseline: keep "
        "(nothing moves between tasks on node events) or equal (equal shares)",
    )


class Register(BaseModel):
    """An agent introduces itself (``POST /v1/agents/register``)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME)
    slots: int = Field(ge=1, le=1024)
    address: str = Field(max_length=256)
    instance: str = Field(min_length=1, max_length=64)


class Heartbeat(BaseModel):
    """An agent is alive."""

    model_config = ConfigDict(extra="forbid")
    instance: str = Field(min_length=1, max_length=64)


class Exchange(BaseModel):
    """One round of a task supervisor: its reports (:mod:`unicron.control.messages`)."""

    model_config = ConfigDict(extra="forbid")
    instance: str = Field(min_length=1, max_length=64)
    read_until: float | None = Field(None, allow_inf_nan=False)
    reports: list[dict[str, Any]] = Field(default_factory=list, max_length=100_000)


def make_app(cluster: Cluster, token: str) -> FastAPI:
    """The FastAPI application over ``cluster`` (a :class:`~unicron.control.cluster.Cluster`).

    The token check and the agents' two calls (``heartbeat``, ``exchange``: nearly every
    request of a busy cluster) are ``async``: they run on the event loop, not in the thread
    pool FastAPI gives plain functions. Each hop into the pool and back cost more CPU than
    the call itself (about half of a request's 1.2 ms; docs/benchmarks.md, "The cluster").
    What they call is short and in memory but for a task's events going to SQLite (a local
    commit each) and, on an epoch change, a write to the store (a local process); the other
    endpoints stay in the pool."""

    async def authorized(request: Request) -> None:
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(value.strip(), token):
            peer = request.client.host if request.client else "?"
            why = "no token" if not given else "a wrong token"
            log.warning("refused %s %s from %s: %s", request.method, request.url.path, peer, why)
            raise HTTPException(401, "missing or wrong token", {"WWW-Authenticate": "Bearer"})

    app = FastAPI(
        title="Unicron coordinator",
        version="1",
        description="The cluster service of Unicron: tasks, nodes, agents, metrics.",
        dependencies=[Depends(authorized)],
    )
    unguarded = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}

    class GuardDocs:
        """The schema and the docs pages are routes the app-wide dependency does not reach:
        they need the token too. A plain ASGI middleware: Starlette's ``@app.middleware``
        (``BaseHTTPMiddleware``) would cost every request a task group and a stream."""

        def __init__(self, inner: ASGIApp) -> None:
            self.inner = inner

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["path"] in unguarded:
                try:
                    await authorized(Request(scope))
                except HTTPException as exc:
                    refused = JSONResponse({"detail": exc.detail}, 401, exc.headers)
                    await refused(scope, receive, send)
                    return
            await self.inner(scope, receive, send)

    app.add_middleware(GuardDocs)

    @app.exception_handler(NotFound)
    def _404(_: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(Conflict)
    def _409(_: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(Invalid)
    def _422(_: Request, exc: Invalid) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    @app.post("/v1/tasks", status_code=201, summary="submit a task")
    def submit(spec: TaskSpec) -> dict[str, Any]:
        return dict(cluster.submit(spec, time.time()))

    @app.get("/v1/tasks", summary="list tasks")
    def tasks() -> list[dict[str, Any]]:
        return list(cluster.task_views())

    @app.get("/v1/tasks/{name}", summary="show a task")
    def task(name: str) -> dict[str, Any]:
        return dict(cluster.task_view(name))

    @app.post("/v1/tasks/{name}/cancel", summary="cancel a task")
    def cancel(name: str) -> dict[str, Any]:
        return dict(cluster.cancel(name, time.time()))

    @app.get("/v1/tasks/{name}/events", summary="a task's events after an id")
    def events(name: str, after: int = 0) -> dict[str, Any]:
        found, last = cluster.events(name, after)
        return {"events": found, "last": last}

    @app.get("/v1/nodes", summary="list nodes")
    def nodes() -> list[dict[str, Any]]:
        return list(cluster.node_views(time.time()))

    from unicron.control.dashboard import PAGE, Dashboard, page

    board = Dashboard(cluster)

    @app.get("/v1/dashboard", summary="the web dashboard's snapshot")
    def dashboard() -> dict[str, Any]:
        return board.snapshot(time.time())

    app.mount(PAGE, page(), name="ui")  # outside the routes' token dependency: no data there

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(cluster.prometheus(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/agents/register", summary="an agent starts or reconnects")
    def register(body: Register) -> dict[str, Any]:
        nid = cluster.register(body.name, body.slots, body.address, body.instance, time.time())
        return {"node": nid}

    @app.post("/v1/agents/{node}/heartbeat", summary="an agent is alive")
    async def heartbeat(node: str, body: Heartbeat) -> JSONResponse:
        return JSONResponse({"tasks": cluster.heartbeat(node, body.instance, time.time())})

    @app.post("/v1/agents/{node}/tasks/{uid}/exchange", summary="one round of a supervisor")
    async def exchange(node: str, uid: str, body: Exchange) -> JSONResponse:
        try:
            reports = [M.from_wire(r) for r in body.reports]
        except ValueError as exc:
            raise Invalid(f"reports: {exc}") from None
        if any(isinstance(r, M.Spawn | M.Kill | M.Probe | M.Reply) for r in reports):
            raise Invalid("reports: an action or reply is not a report")
        reply = cluster.exchange(node, body.instance, uid, reports, time.time(), body.read_until)
        return JSONResponse(M.to_wire(reply))

    return app


def serve(cluster: Cluster, token: str, host: str, port: int) -> uvicorn.Server:
    """A uvicorn server for the app (``server.run()`` blocks; ``server.should_exit`` stops)."""
    import uvicorn

    config = uvicorn.Config(
        make_app(cluster, token),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    return uvicorn.Server(config)


def main(args: argparse.Namespace) -> int:
    from unicron.control.cluster import ACTIVE, Cluster, ClusterSettings

    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    advertise = args.advertise or args.host
    if advertise in ("0.0.0.0", "::"):
        raise UsageError("--host 0.0.0.0 needs --advertise ADDR (where agents reach this host)")
    if not args.node_timeout > 0:
        raise UsageError(f"--node-timeout must be > 0 seconds, got {args.node_timeout}")
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("unicron.control.cluster").setLevel(logging.INFO)
    state_dir = Path(args.state_dir)
    cluster = Cluster(
        state_dir,
        host=advertise,
        settings=ClusterSettings(node_timeout_s=args.node_timeout, placement=args.placement),
    )
    token = resolve_token(args.token_file, state_dir)
    server = serve(cluster, token, args.host, args.port)
    cluster.start_ticker()
    print(
        f"unicron coordinator on http://{advertise}:{args.port} (state {state_dir}, "
        f"store {cluster.store.address})",
        file=sys.stderr,
        flush=True,
    )
    gc.freeze()  # the imports' objects: the collector's full passes skip them (runner.main)
    try:
        server.run()
    finally:
        active = any(t.row.state in ACTIVE for t in cluster.tasks.values())
        cluster.close(stop_store=not active)  # with tasks running the store stays for them
    return 0
