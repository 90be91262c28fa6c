"""``unicron coordinator``: the cluster service, an HTTP/JSON API (FastAPI on uvicorn).

Users (``unicron submit|status|cancel|logs``, :mod:`unicron.control.client`) and agents
(:mod:`unicron.control.node`) talk to it; every request carries a token (``Authorization:
Bearer TOKEN``): the admin's, a user's or a node's agent's (:mod:`unicron.control.credentials`).
:class:`Door` checks it before the body is read: 401 without a known one, 403 outside its
role, 413 for a body over :data:`MAX_BODY_BYTES`, each with a log line, never data. HTTPS
with ``--tls-cert``/``--tls-key``; plain HTTP only on loopback unless ``--insecure-http``
(docs/security.md). The OpenAPI schema is served at ``/openapi.json``.

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

Errors are 4xx with ``{"detail": "one line"}``: 401/403/413 from the door, 404 unknown task
or node, 409 a conflict with the cluster's state, 422 a body that is not valid (FastAPI
names the field) or an agent's report the cluster refuses (``screen.screen``; the body's
``refused`` then gives the report's position, and the agent drops that one report).

The dashboard's page and scripts under ``/ui/`` are the only paths served without the token:
they are the same files for everyone and hold no data. The page asks for the token, keeps it
in the tab's ``sessionStorage`` and sends it as the bearer header of its ``fetch`` calls
(never in a URL); see docs/cluster.md, "Dashboard".
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from unicron import messages as M
from unicron.control.client import ENV_TOKEN, resolve_token, token_path
from unicron.control.cluster import Cluster, Invalid
from unicron.control.credentials import FILE as CREDENTIALS
from unicron.control.credentials import Credentials, Principal
from unicron.control.dashboard import PAGE, Dashboard, is_page, page
from unicron.control.lease import TTL_S, Leadership
from unicron.control.nodetable import Conflict, Fenced, NotFound
from unicron.control.taskspec import NAME, TaskSpec
from unicron.errors import UsageError
from unicron.planner.hardware import GPU_PRESETS

if TYPE_CHECKING:
    import uvicorn

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
    p.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", metavar="FILE", help="... and this private key (PEM)")
    p.add_argument(
        "--insecure-http",
        action="store_true",
        help="serve plain HTTP on a non-loopback --host (refused otherwise; docs/security.md)",
    )
    p.add_argument(  # baselines for bench/simreal.py (docs/cluster.md, placement)
        "--placement",
        choices=("planner", "keep", "equal"),
        default="planner",
        help="who sets each task's worker count: the planner (default), or a baseline: keep "
        "(nothing moves between tasks on node events) or equal (equal shares)",
    )
    p.add_argument(
        "--gpu",
        choices=tuple(GPU_PRESETS),
        default="A100-80GB",
        help="what a slot is to the performance model, for tasks that describe their model "
        "(default A100-80GB; a node's slots are its GPUs)",
    )
    p.add_argument(
        "--etcd",
        metavar="URL",
        help="lead through a lease in this etcd: coordinators of one --state-dir (a shared "
        "file system) and --ha-name wait as standbys until they lead (docs/cluster.md, A "
        "standby coordinator)",
    )
    p.add_argument("--ha-name", default="unicron", help="the lead they campaign for")
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=TTL_S,
        help=f"seconds a lost leader's lease lives (a standby leads then; default {TTL_S:g})",
    )


class Register(BaseModel):
    """An agent introduces itself (``POST /v1/agents/register``)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME)
    slots: int = Field(ge=1, le=1024)
    address: str = Field(max_length=256)
    instance: str = Field(min_length=1, max_length=64)
    gpus: int | None = Field(None, ge=0, le=1024)
    """CUDA devices on the node (``None``: not said, an agent of an older release)"""


class Heartbeat(BaseModel):
    """An agent is alive."""

    model_config = ConfigDict(extra="forbid")
    instance: str = Field(min_length=1, max_length=64)


class Exchange(BaseModel):
    """One round of a task supervisor: its reports (:mod:`unicron.messages`)."""

    model_config = ConfigDict(extra="forbid")
    instance: str = Field(min_length=1, max_length=64)
    read_until: float | None = Field(None, allow_inf_nan=False)
    reports: list[dict[str, Any]] = Field(default_factory=list, max_length=100_000)
    first: int | None = Field(None, ge=0)
    """the running index of the first report (a census excepted) among those this agent
    sent for the task: a report sent again after a lost answer is not applied twice"""


MAX_BODY_BYTES = 8 << 20
"""a request body above this is refused (413) before it is parsed: a busy node's exchange
carries a few kilobytes"""


class Door:
    """Every request passes here first, before routing and before its body is read (a plain
    ASGI middleware: Starlette's ``BaseHTTPMiddleware`` would cost every request a task
    group and a stream). It answers, without calling the app:

    - 401 to a request without a known, unexpired bearer token (logged: who, what, why);
    - 403 to a principal whose role does not reach the path (an agent outside its own
      node's ``/v1/agents/NODE/...``, a user on an agent's path);
    - 413 to a body over :data:`MAX_BODY_BYTES` (by its length, or as it streams in).

    The principal goes to the app in ``scope["unicron.principal"]``."""

    def __init__(self, inner: Any, credentials: Credentials, max_body: int) -> None:
        self.inner = inner
        self.credentials = credentials
        self.max_body = max_body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or is_page(scope["path"]):
            await self.inner(scope, receive, send)  # the lifespan; the dashboard's page
            return
        headers = dict(scope.get("headers") or ())
        given = headers.get(b"authorization", b"")
        scheme, _, value = given.partition(b" ")
        who = self.credentials.who(value.strip()) if scheme.lower() == b"bearer" else None
        if scope["type"] == "websocket":  # none is served yet; one would need the token too
            if who is None or not allowed(who, scope["path"]):
                await send({"type": "websocket.close", "code": 1008})
                return
            scope["unicron.principal"] = who
            await self.inner(scope, receive, send)
            return
        if who is None:
            why = "no token" if not given else "a wrong token"
            await self._refuse(scope, receive, send, 401, "missing or wrong token", why)
            return
        if not allowed(who, scope["path"]):
            why = f"{who.role} {who.name} may not"
            await self._refuse(scope, receive, send, 403, f"{why} {scope['path']}", why)
            return
        scope["unicron.principal"] = who
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body:
            await self._refuse(scope, receive, send, 413, "the body is too large", "big body")
            return
        body = b""
        if scope["method"] in ("POST", "PUT", "PATCH"):
            more = True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > self.max_body:
                    await self._refuse(scope, receive, send, 413, "the body is too large", "big")
                    return
        await self.inner(scope, _replay(body, receive), send)

    async def _refuse(
        self, scope: Any, receive: Any, send: Any, status: int, detail: str, why: str
    ) -> None:
        peer = (scope.get("client") or ("?",))[0]
        log.warning("refused %s %s from %s: %s", scope["method"], scope["path"], peer, why)
        extra = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        await JSONResponse({"detail": detail}, status, extra)(scope, receive, send)


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that hands the app the body :class:`Door` already read, then waits on
    the client as the original would (a disconnect)."""
    sent = False

    async def again() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def allowed(who: Principal, path: str) -> bool:
    """Whether ``who``'s role reaches ``path`` at all (finer checks, a task's owner, an
    agent's registered name, are the handlers'): an admin everything; an agent only
    ``/v1/agents/register`` and its own node's ``/v1/agents/NAME/...``; a user everything
    but the agents' paths."""
    if who.role == "admin":
        return True
    parts = path.split("/")
    agents = parts[:3] == ["", "v1", "agents"]
    if who.role == "user":
        return not agents
    return agents and len(parts) > 3 and parts[3] in ("register", who.name)


def principal(request: Request) -> Principal:
    """The caller :class:`Door` let in (a dependency of the handlers that need it)."""
    who = request.scope.get("unicron.principal")
    assert isinstance(who, Principal), "the door lets no request in without a principal"
    return who


BEARER = HTTPBearer(auto_error=False, description="the admin's, a user's or an agent's token")


async def declared(_: Annotated[Any, Depends(BEARER)]) -> None:
    """Declares the bearer scheme in the OpenAPI schema (``/docs``' Authorize button); the
    check itself is :class:`Door`'s, before the body is read."""


def shown(view: dict[str, Any], who: Principal) -> dict[str, Any]:
    """A task's view as ``who`` may see it: another user's task without its ``uid`` (the
    secret prefix of its keys in the training store; docs/security.md)."""
    if who.role == "admin" or view.get("owner") == who.name:
        return dict(view)
    return {**view, "uid": None}


def make_app(
    cluster: Cluster, token: str | Credentials, *, max_body: int = MAX_BODY_BYTES
) -> FastAPI:
    """The FastAPI application over ``cluster`` (a :class:`~unicron.control.cluster.Cluster`),
    behind :class:`Door`; ``token``: the admin token, or every credential.

    The agents' two calls (``heartbeat``, ``exchange``: nearly every request of a busy
    cluster) are ``async``: they run on the event loop, not in the thread pool FastAPI gives
    plain functions. Each hop into the pool and back cost more CPU than the call itself
    (about half of a request's 1.2 ms; `bench/results/cluster-history.md`).
    What they call is short and in memory but for a task's events going to SQLite (a local
    commit each) and, on an epoch change, a write to the store (a local process); the other
    endpoints stay in the pool."""
    credentials = token if isinstance(token, Credentials) else Credentials(token)
    app = FastAPI(
        title="Unicron coordinator",
        version="1",
        description="The cluster service of Unicron: tasks, nodes, agents, metrics.",
        dependencies=[Depends(declared)],
    )
    app.add_middleware(Door, credentials=credentials, max_body=max_body)

    @app.exception_handler(NotFound)
    def _404(_: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(Conflict)
    def _409(_: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(Invalid)
    def _422(_: Request, exc: Invalid) -> JSONResponse:
        body: dict[str, Any] = {"detail": str(exc)}
        if exc.index is not None:  # one report to blame: the agent drops it, resends the rest
            body["refused"] = exc.index
        return JSONResponse(body, status_code=422)

    @app.exception_handler(Fenced)
    def _410(_: Request, exc: Fenced) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=410)

    @app.post("/v1/tasks", status_code=201, summary="submit a task")
    def submit(spec: TaskSpec, who: Annotated[Principal, Depends(principal)]) -> dict[str, Any]:
        return dict(cluster.submit(spec, time.time(), owner=who.name))

    @app.get("/v1/tasks", summary="list tasks")
    def tasks(who: Annotated[Principal, Depends(principal)]) -> list[dict[str, Any]]:
        return [shown(v, who) for v in cluster.task_views()]

    @app.get("/v1/tasks/{name}", summary="show a task")
    def task(name: str, who: Annotated[Principal, Depends(principal)]) -> dict[str, Any]:
        return shown(cluster.task_view(name), who)

    @app.post("/v1/tasks/{name}/cancel", summary="cancel a task")
    def cancel(name: str, who: Annotated[Principal, Depends(principal)]) -> dict[str, Any]:
        owner = cluster.task_view(name)["owner"]
        if who.role != "admin" and owner != who.name:
            log.warning("refused cancel of %s by %s %s: owned by %s", name, who.role, who.name,
                        owner)  # fmt: skip
            raise HTTPException(403, f"task {name} belongs to {owner}; only they or an admin "
                                "may cancel it")  # fmt: skip
        return dict(cluster.cancel(name, time.time()))

    @app.get("/v1/tasks/{name}/events", summary="a task's events after an id")
    def events(
        name: str,
        who: Annotated[Principal, Depends(principal)],
        after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    ) -> dict[str, Any]:
        found, last = cluster.events(name, after)
        view = cluster.task_view(name)
        text = json.dumps(found)  # a diverged loss is NaN: JSON has no word for it
        if shown(view, who)["uid"] is None:  # a checkpoint's path names it
            text = text.replace(view["uid"], f"{name}.(hidden)")
        return {"events": json.loads(text, parse_constant=str), "last": last}

    @app.get("/v1/nodes", summary="list nodes")
    def nodes() -> list[dict[str, Any]]:
        return list(cluster.node_views(time.time()))

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
    def register(body: Register, who: Annotated[Principal, Depends(principal)]) -> dict[str, Any]:
        if who.role == "agent" and body.name != who.name:
            log.warning("refused register of node %s by agent %s", body.name, who.name)
            raise HTTPException(403, f"agent {who.name} may register only node {who.name}")
        nid = cluster.register(
            body.name, body.slots, body.address, body.instance, time.time(), gpus=body.gpus
        )
        return {"node": nid}

    @app.post("/v1/agents/{node}/heartbeat", summary="an agent is alive")
    async def heartbeat(node: str, body: Heartbeat) -> JSONResponse:
        tasks = cluster.heartbeat(node, body.instance, time.time())
        return JSONResponse({"tasks": [M.to_wire(a) for a in tasks]})

    @app.post("/v1/agents/{node}/tasks/{uid}/exchange", summary="one round of a supervisor")
    async def exchange(node: str, uid: str, body: Exchange) -> JSONResponse:
        reports = []
        for i, raw in enumerate(body.reports):
            try:
                r = M.from_wire(raw)
            except ValueError as exc:
                raise Invalid(f"reports[{i}]: {exc}", index=i) from None
            if not M.is_report(r):
                raise Invalid(f"reports[{i}]: a {type(r).__name__} is not a report", index=i)
            reports.append(r)
        reply = cluster.exchange(
            node, body.instance, uid, reports, time.time(), body.read_until, body.first
        )
        return JSONResponse(M.to_wire(reply))

    return app


def serve(
    cluster: Cluster,
    token: str | Credentials,
    host: str,
    port: int,
    *,
    tls: tuple[str, str] | None = None,
) -> uvicorn.Server:
    """A uvicorn server for the app (``server.run()`` blocks; ``server.should_exit`` stops);
    ``tls``: (certificate, key) files, the API is then served over HTTPS only."""
    import uvicorn

    config = uvicorn.Config(
        make_app(cluster, token),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    return uvicorn.Server(config)


def loopback(host: str) -> bool:
    """Whether ``host`` is an address of this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tls_files(args: argparse.Namespace) -> tuple[str, str] | None:
    """The certificate and key to serve with, checked; ``None``: plain HTTP, allowed only on
    a loopback address or with ``--insecure-http`` (docs/security.md)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    if args.tls_cert:
        for flag, f in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
            if not Path(f).is_file():
                raise UsageError(f"{flag} {f}: no such file")
        return str(args.tls_cert), str(args.tls_key)
    if not loopback(args.host) and not args.insecure_http:
        raise UsageError(
            f"--host {args.host} is not a loopback address: serve TLS (--tls-cert, --tls-key; "
            "docs/security.md) or pass --insecure-http on a network you trust"
        )
    return None


def main(args: argparse.Namespace) -> int:
    from unicron.control.cluster import ACTIVE, Cluster, ClusterSettings

    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    advertise = args.advertise or args.host
    if advertise in ("0.0.0.0", "::"):
        raise UsageError("--host 0.0.0.0 needs --advertise ADDR (where agents reach this host)")
    if not args.node_timeout > 0:
        raise UsageError(f"--node-timeout must be > 0 seconds, got {args.node_timeout}")
    if not args.lease_ttl >= 1.0:
        raise UsageError(f"--lease-ttl must be >= 1 second, got {args.lease_ttl}")
    tls = tls_files(args)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("unicron.control.cluster").setLevel(logging.INFO)
    os.umask(0o077)  # every file of the state directory: the owner's only
    state_dir = Path(args.state_dir)
    lead = None
    if args.etcd:  # a standby waits here until it leads (docs/cluster.md, A standby coordinator)
        me = f"{'https' if tls else 'http'}://{advertise}:{args.port}"
        lead = Leadership(args.etcd, args.ha_name, me, ttl_s=args.lease_ttl)
        print(f"unicron coordinator {me}: standby until it leads {lead.key}", file=sys.stderr,
              flush=True)  # fmt: skip
        lead.acquire()
        lead.hold()
    cluster = Cluster(  # first: it refuses a directory that is not a state's
        state_dir,
        host=advertise,
        settings=ClusterSettings(
            node_timeout_s=args.node_timeout, placement=args.placement, gpu=args.gpu
        ),
    )
    try:
        token = resolve_token(args.token_file, state_dir)
        credentials = Credentials(
            token, admin_file=token_path(args.token_file, state_dir), path=state_dir / CREDENTIALS
        )
        server = serve(cluster, credentials, args.host, args.port, tls=tls)
        cluster.start_ticker()
        scheme = "https" if tls else "http"
        print(
            f"unicron coordinator on {scheme}://{advertise}:{args.port} (state {state_dir}, "
            f"store {cluster.store.info.address})",
            file=sys.stderr,
            flush=True,
        )
        gc.freeze()  # the imports' objects: the collector's full passes skip them (runner.main)
        run(server)
    finally:
        active = any(t.row.state in ACTIVE for t in cluster.tasks.values())
        cluster.close(stop_store=not active)  # with tasks running the store stays for them
        if lead is not None:
            lead.resign()  # a standby leads at once
    return 0


def run(server: Any) -> None:
    """``server.run()``, returning on SIGTERM: uvicorn catches the signal, stops serving, puts
    back the handler it found and raises the signal again. Python's default for SIGTERM
    would then kill this process before its ``finally`` stops the store; the handler put
    here first only asks the server to stop (a SIGTERM before uvicorn listens, too). SIGINT
    comes back as ``KeyboardInterrupt``, which unwinds through the same ``finally``."""
    import signal

    def stop(*_: Any) -> None:
        server.should_exit = True

    signal.signal(signal.SIGTERM, stop)
    server.run()
