"""Talking to the cluster service over HTTP: the client, an agent's link, the user commands.

:class:`Client` is the one HTTP client (httpx, the token on every request). :class:`TaskLink`
is an agent's :class:`~unicron.control.agent.CoordinatorLink` on a cluster: it keeps the
reports of rounds the coordinator did not answer (it is restarting, or the network is out),
retries with backoff, and delivers them in order once it is back, the agent's
:class:`~unicron.messages.Census` first. ``unicron submit|status|cancel|logs``
(:func:`main`) use only the HTTP API.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unicron import messages as M
from unicron.errors import UsageError

log = logging.getLogger("unicron.control.agent")

ENV_TOKEN = "UNICRON_TOKEN"
"""the cluster's token, for the service and for every client (else ``--token-file``)"""
ENV_COORDINATOR = "UNICRON_COORDINATOR"
ENV_CA = "UNICRON_CA_FILE"
"""the CA bundle that verifies an ``https`` coordinator (else ``--ca-file``)"""
DEFAULT_URL = "http://127.0.0.1:29400"


def resolve_token(token_file: str | None, state_dir: Path | None = None) -> str:
    """The token: ``token_file``'s content, ``$UNICRON_TOKEN``, or (for the service only) the
    state directory's ``token`` file, created with a fresh random token if missing. A token
    that cannot be a bearer token (blank, non-ASCII, spaces) is a one-line
    :class:`UsageError`."""
    from unicron.control.credentials import check_token, write_private

    path = token_path(token_file, state_dir)
    if path is None:
        if ENV_TOKEN not in os.environ:
            raise UsageError(f"no token: pass --token-file FILE or set ${ENV_TOKEN}")
        return check_token(os.environ[ENV_TOKEN].strip(), f"${ENV_TOKEN}")
    if token_file is None and not path.exists():
        write_private(path, secrets.token_urlsafe(32) + "\n")
    where = f"--token-file {token_file}" if token_file else str(path)
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where}: {getattr(exc, 'strerror', None) or exc}") from None
    return check_token(token, where)


def token_path(token_file: str | None, state_dir: Path | None = None) -> Path | None:
    """The file the token of :func:`resolve_token` comes from: ``token_file``; else
    ``None`` (the environment) when ``$UNICRON_TOKEN`` is set, even blank (refused then, not
    ignored); else the state directory's ``token`` (the service), or ``None``. A client
    re-reads the file when the service refuses its token (a rotated credential)."""
    if token_file:
        return Path(token_file)
    if ENV_TOKEN in os.environ or state_dir is None:
        return None
    return state_dir / "token"


FAILOVER_CONNECT_S = 1.0
"""with several coordinator URLs: how long connecting to one may take before the next is
tried (a leader's host lost does not refuse, it stays silent)"""
FAILOVER_READ_S = 3.0
"""... and how long an answer may take (a request in flight when the host was lost)"""


class ServiceError(RuntimeError):
    """The service answered 4xx/5xx; ``status``, its one-line ``detail`` and ``refused``: the
    position of the report an exchange was refused for (a 422's ``refused``), else ``None``."""

    def __init__(self, status: int, detail: str, refused: int | None = None) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail
        self.refused = refused


class Client:
    """One HTTP connection pool to the coordinator, the token on every request.

    ``token_file``: where the token came from; refused once (401), the client reads it again
    and, if it changed (the credential was rotated), retries with the new one: an agent
    goes on through a rotation without a restart. ``verify``: for an ``https`` URL, the CA
    bundle to check the coordinator's certificate against (``None``: the system's).

    ``url`` may name several coordinators, comma-separated (a leader and its standbys,
    docs/cluster.md, A standby coordinator): a request that cannot reach the one in use is
    made once more to the next (a standby does not listen until it leads), and the client
    stays with whichever answered; connecting to each then gives up after
    :data:`FAILOVER_CONNECT_S`."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 10.0,
        token_file: Path | None = None,
        verify: str | None = None,
    ) -> None:
        import httpx

        self.urls = [u.strip().rstrip("/") for u in url.split(",") if u.strip()]
        self.url = self.urls[0]
        self.token_file = token_file
        self._token = token
        several = len(self.urls) > 1  # a lost leader's host answers nothing: give it up soon
        self._http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(
                min(timeout_s, FAILOVER_READ_S) if several else timeout_s,
                connect=min(timeout_s, FAILOVER_CONNECT_S) if several else timeout_s,
            ),
            trust_env=False,  # never through a proxy: the coordinator is on our network
            verify=_ssl_context(verify) if self.url.startswith("https://") else True,
        )

    def _rotated(self) -> bool:
        """Whether the token file now holds another valid token (then it is used)."""
        from unicron.control.credentials import TOKEN_CHARS

        if self.token_file is None:
            return False
        try:
            token = self.token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return False
        if token == self._token or not TOKEN_CHARS.match(token):
            return False
        self._token = token
        self._http.headers["Authorization"] = f"Bearer {token}"
        return True

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """The decoded JSON answer; :class:`ServiceError` for 4xx/5xx; ``httpx.TransportError``
        when the coordinator cannot be reached (the next one of :attr:`urls` too)."""

        r = self._http.request(method, path, **kwargs) if len(self.urls) == 1 else None
        if r is None:  # several coordinators: the one in use, else the others in turn
            r = self._failover(method, path, **kwargs)
        if r.status_code == 401 and self._rotated():
            r = self._http.request(method, path, **kwargs)
        if r.status_code >= 400:
            try:
                answer = r.json()
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                answer = {"detail": r.text}
            detail = answer.get("detail", r.text)
            if isinstance(detail, list):  # FastAPI's validation errors: all, on one line
                detail = "; ".join(_problem(d) for d in detail if isinstance(d, dict))
            refused = answer.get("refused")
            refused = refused if type(refused) is int else None
            raise ServiceError(r.status_code, str(detail), refused)
        if r.headers.get("content-type", "").startswith("application/json"):
            return r.json()
        return r.text

    def _failover(self, method: str, path: str, **kwargs: Any) -> Any:
        """The answer of the first coordinator that answers, from the one in use on, which it
        becomes. When none does, the client stays with one that refused the connection (a
        standby's host, alive, leading soon) rather than one that let it time out (a lost
        leader's)."""
        import httpx

        at = self.urls.index(self.url)
        refused: str | None = None
        last: httpx.TransportError | None = None
        for url in self.urls[at:] + self.urls[:at]:
            self._http.base_url = httpx.URL(url)
            try:
                r = self._http.request(method, path, **kwargs)
            except httpx.ConnectError as exc:
                refused, last = refused or url, exc
                continue
            except httpx.TransportError as exc:
                last = exc
                continue
            self.url = url
            return r
        self.url = refused or self.url
        self._http.base_url = httpx.URL(self.url)
        assert last is not None
        raise last

    def close(self) -> None:
        self._http.close()


def _problem(err: dict[str, Any]) -> str:
    """One of FastAPI's validation errors as ``field.path: message``."""
    where = ".".join(str(p) for p in err.get("loc", ())[1:])
    return f"{where}: {err.get('msg', '')}".strip(": ")


def can_wait(report: M.Report) -> bool:
    """Whether ``report`` may wait for the next exchange of the rhythm: a step's begin, its
    computed report and its ``step_end`` record (all but the task's first commit, which
    makes the coordinator write the ``trained`` key that starting workers read). They feed
    the step statistics and the event log only, they carry their own time, and the detectors
    judge a node only up to the ``read_until`` of its last exchange, which covers every report
    it carried; a training task's workers send a dozen of them per step (docs/cluster.md,
    The rhythm)."""
    if isinstance(report, M.StepBegan | M.StepComputed):
        return True
    return (
        isinstance(report, M.Event)
        and report.name == "step_end"
        and int(report.fields.get("step", 0)) > 0
    )


class TaskLink:
    """An agent's link to the coordinator of task ``uid`` over HTTP (see the module
    docstring). ``census`` is the agent's :meth:`~unicron.control.agent.Agent.census`.

    A report goes out at once (in the agent's round that read it; a worker's message behind
    it rang the agent's doorbell), with every report held before it, unless it may wait
    (:func:`can_wait`: a worker's step reports); with nothing else to report the link
    exchanges at the rhythm the coordinator's last reply
    asked for (:meth:`interval`: every 250 ms when nothing is due, at a computing worker's
    hang deadline, every 50 ms while the coordinator waits on this node; docs/cluster.md,
    The rhythm), carrying the reports held until then."""

    MIN_INTERVAL_S = 0.05
    """with nothing to report, never exchange more often than this"""
    MAX_INTERVAL_S = 1.0
    """... nor less often than this, whatever the coordinator asks"""
    MAX_BACKOFF_S = 0.5

    def __init__(
        self,
        client: Client,
        node_name: str,
        instance: str,
        uid: str,
        census: Callable[[], M.Census],
    ) -> None:
        self.client = client
        self.uid = uid
        self.path = f"/v1/agents/{node_name}/tasks/{uid}/exchange"
        self.instance = instance
        self.census = census
        self._pending: list[M.Report] = []
        self._first = 0  # the index of _pending[0] among the reports sent (the census aside)
        self._urgent = False  # a pending report that must not wait for the rhythm
        self._last = M.Reply()
        self._last_ok = 0.0
        self._retry_at = 0.0
        self._backoff = 0.05
        self._reconnect = True  # the first exchange carries the census too
        self.down_since: float | None = None

    def interval(self) -> float:
        """With nothing to report, the next exchange is due this long after the last one: the
        rhythm the coordinator's last reply asked for (:attr:`~unicron.messages.Reply.
        next_s`), within [:attr:`MIN_INTERVAL_S`, :attr:`MAX_INTERVAL_S`]."""
        asked = self._last.next_s
        if math.isnan(asked):
            return self.MIN_INTERVAL_S
        return min(max(asked, self.MIN_INTERVAL_S), self.MAX_INTERVAL_S)

    def due_in(self, now: float) -> float:
        """Seconds from ``now`` until :meth:`exchange` goes out with nothing new to report:
        at once while a report waits that may not, after a failure at its retry, else at the
        rhythm (the agent's round sleeps until then: :meth:`~unicron.control.agent.Agent.
        round_s`)."""
        if now < self._retry_at:
            return self._retry_at - now
        if self._urgent:
            return 0.0
        return max(self._last_ok + self.interval() - now, 0.0)

    def exchange(
        self,
        node: int,
        reports: list[M.Report],
        now: float,
        *,
        read_until: float | None = None,
        flush: bool = False,
    ) -> M.Reply:
        """One round of the agent: ``reports`` go out now, or wait for the rhythm (see the
        class docstring); ``flush``: everything pending goes out now (the agent's last round),
        even in a failed exchange's backoff (found in review: a failure in the last half
        second lost the held ``step_end`` records with the link)."""
        import httpx

        self._pending += reports
        self._urgent = self._urgent or flush or not all(can_wait(r) for r in reports)
        idle = M.Reply(over=self._last.over, finished=self._last.finished)
        if not flush and self.due_in(now) > 0:
            return idle
        batch = list(self._pending)
        if self._reconnect:
            batch.append(self.census())
        body = {
            "instance": self.instance,
            "read_until": read_until,
            "reports": [M.to_wire(r) for r in batch],
            "first": self._first,
        }
        try:
            reply = M.from_wire(self.client.request("POST", self.path, json=body))
        except (httpx.DecodingError, ValueError) as exc:  # an answer that cannot be read
            log.warning("task %s: an unreadable answer, taken as lost: %s", self.uid, exc)
            return self._failed(now, idle)
        except (httpx.TransportError, ServiceError) as exc:
            held = (401, 404, 410)
            if isinstance(exc, ServiceError) and exc.refused is not None:
                return self._refused(exc, batch, idle)
            if isinstance(exc, ServiceError) and exc.status < 500 and exc.status not in held:
                raise  # refused (superseded, a bad request): the agent's business
            # 401: its credential was rotated and its file not yet rewritten; 410: the node
            # was declared lost (its agent's heartbeat learns it too, and stops this task's
            # workers): the reports wait, as for a coordinator that is away
            return self._failed(now, idle)
        self._first += len(self._pending)
        self._pending.clear()
        self._urgent = False
        self._reconnect = False
        self._backoff = 0.05
        self.down_since = None
        self._last, self._last_ok = reply, now
        assert isinstance(reply, M.Reply)
        return reply

    def _failed(self, now: float, idle: M.Reply) -> M.Reply:
        """The exchange failed, or its answer was lost: the reports wait for the next try
        (after a backoff), which carries the agent's census too."""
        if self.down_since is None:
            self.down_since = now
        self._reconnect = True
        self._retry_at = now + self._backoff
        self._backoff = min(self._backoff * 2, self.MAX_BACKOFF_S)
        return idle

    def _refused(self, exc: ServiceError, batch: list[M.Report], idle: M.Reply) -> M.Reply:
        """The cluster refused the exchange for one report (a 422 naming its position in
        ``batch``: a report no agent of this release should send, docs/cluster.md): that report
        is dropped, loudly, and the others go out again in the next round. Kept, it would be
        refused in every later exchange and silence every report of this task from this
        node until the node was judged lost."""
        i = exc.refused
        if i is None or not 0 <= i < len(batch):
            raise exc
        log.error("task %s: the cluster refused a report, dropped: %s (%s)",
                  self.uid, batch[i], exc.detail)  # fmt: skip
        if i < len(self._pending):
            del self._pending[i]
        else:  # the census, sent after the pending reports
            self._reconnect = False
        self._urgent = True
        return idle


# -- the user commands -----------------------------------------------------------------------
def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--coordinator",
        metavar="URL",
        default=os.environ.get(ENV_COORDINATOR, DEFAULT_URL),
        help=f"the cluster service (default ${ENV_COORDINATOR} or {DEFAULT_URL}); several, "
        "comma-separated: a leader and its standbys",
    )
    p.add_argument("--token-file", metavar="FILE", help="the token (else $UNICRON_TOKEN)")
    p.add_argument(
        "--ca-file",
        metavar="FILE",
        default=os.environ.get(ENV_CA),
        help=f"for an https URL: the CA that signed the coordinator's certificate (default "
        f"${ENV_CA}, else the system's)",
    )


def connect(args: argparse.Namespace) -> Client:
    for url in str(args.coordinator).split(","):
        if not url.strip().startswith(("http://", "https://")):
            raise UsageError(f"--coordinator must be http(s) URLs, got {args.coordinator!r}")
    token = resolve_token(args.token_file)
    return Client(
        args.coordinator,
        token,
        token_file=token_path(args.token_file),
        verify=getattr(args, "ca_file", None),
    )


def call(client: Client, method: str, path: str, **kwargs: Any) -> Any:
    """One request as a command makes it: errors become one line (exit 2 for 4xx, 1 when
    the service cannot be reached)."""
    import httpx

    try:
        return client.request(method, path, **kwargs)
    except ServiceError as exc:
        if exc.status < 500:
            raise UsageError(exc.detail) from None
        raise SystemExit(f"unicron: error: the coordinator failed: {exc.detail}") from None
    except httpx.TransportError as exc:
        raise SystemExit(f"unicron: error: cannot reach {client.url}: {exc}") from None


def add_submit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("task_file", metavar="TASK.yaml", help="the task file")
    p.add_argument("--json", action="store_true", help="print the task as JSON")
    add_connection_arguments(p)


def submit_main(args: argparse.Namespace) -> int:
    from unicron.control.taskspec import load

    spec = load(Path(args.task_file))
    client = connect(args)
    view = call(client, "POST", "/v1/tasks", json=spec.model_dump())
    if args.json:
        print(json.dumps(view, indent=2))
    else:
        print(f"submitted {view['name']}: {view['state']}")
    return 0


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", nargs="?", metavar="TASK", help="one task (default: all, and nodes)")
    p.add_argument("--json", action="store_true", help="JSON instead of tables")
    add_connection_arguments(p)


def status_main(args: argparse.Namespace) -> int:
    client = connect(args)
    if args.task:
        tasks = [call(client, "GET", f"/v1/tasks/{args.task}")]
        nodes = None
    else:
        tasks = call(client, "GET", "/v1/tasks")
        nodes = call(client, "GET", "/v1/nodes")
    if args.json:
        print(json.dumps(tasks[0] if args.task else {"tasks": tasks, "nodes": nodes}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    if nodes is not None:
        table = Table(title="nodes")
        for col in ("node", "state", "slots", "used", "address", "silent"):
            table.add_column(col)
        for n in nodes:
            table.add_row(*plain(
                n["name"], n["state"], str(n["slots"]), str(n["used"]), n["address"],
                f"{n['silent_s']:.1f} s",
            ))  # fmt: skip
        console.print(table)
    table = Table(title="tasks")
    for col in ("task", "owner", "state", "epoch", "step", "workers", "min..max", "last fault",
                "note"):  # fmt: skip
        table.add_column(col)
    for t in tasks:
        note = t["waiting"] or ((t.get("outcome") or {}).get("reason") or "")
        table.add_row(*plain(
            t["name"], t.get("owner", "-"), t["state"], str(t["epoch"]),
            str(t["step"] + 1 if t["step"] >= 0 else "-"), str(t["workers"]),
            f"{t['min_workers']}..{t['max_workers']}", t["last_fault"] or "-", note,
        ))  # fmt: skip
    console.print(table)
    errors = sorted({t["plan_error"] for t in tasks if t.get("plan_error")})
    for error in errors:  # the cluster keeps its allocation while the planner fails
        console.print(f"planner error (allocation kept): {error}", markup=False)
    return 0


def plain(*cells: Any) -> list[Any]:
    """Table cells as plain text: what users and workers wrote (task names, notes, reasons)
    is shown as it is, never read as ``rich`` markup (``[/x]`` in a reason would crash the
    table)."""
    from rich.text import Text

    return [Text(str(c)) for c in cells]


def add_cancel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", metavar="TASK")
    add_connection_arguments(p)


def cancel_main(args: argparse.Namespace) -> int:
    view = call(connect(args), "POST", f"/v1/tasks/{args.task}/cancel")
    print(f"{view['name']}: {view['state']}")
    return 0


def add_logs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", metavar="TASK")
    p.add_argument("--follow", "-f", action="store_true", help="wait for more until it ends")
    p.add_argument("--json", action="store_true", help="the events as JSON Lines")
    add_connection_arguments(p)


def logs_main(args: argparse.Namespace) -> int:
    """A task's events, one readable line each (``--json``: the JSON Lines as stored);
    ``--follow`` until its ``task_end``."""
    from unicron.control.report import event_line

    client = connect(args)
    after = 0
    while True:
        got = call(client, "GET", f"/v1/tasks/{args.task}/events", params={"after": after})
        for e in got["events"]:
            print(json.dumps(e) if args.json else event_line(e), flush=True)
            if e["event"] == "task_end" and args.follow:
                return 0
        after = got["last"]
        if not args.follow:
            return 0
        if not got["events"]:
            time.sleep(0.5)


def fetch_events(client: Client, task: str) -> list[dict[str, Any]]:
    """Every event of ``task`` so far, oldest first (the API answers in pages)."""
    out: list[dict[str, Any]] = []
    after = 0
    while True:
        got = call(client, "GET", f"/v1/tasks/{task}/events", params={"after": after})
        if not got["events"]:
            return out
        out += got["events"]
        after = got["last"]


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", metavar="TASK")
    p.add_argument("--json", action="store_true", help="the incidents and outcome as JSON")
    add_connection_arguments(p)


def report_main(args: argparse.Namespace) -> int:
    """``unicron report TASK``: the healing timeline of a cluster task, from its event log
    on the coordinator: the table ``unicron run`` prints at its end
    (:func:`unicron.control.report.render`)."""
    from rich.console import Console

    from unicron.control.report import render, summary

    events = fetch_events(connect(args), args.task)
    if args.json:
        print(json.dumps(summary(events), indent=2))
        return 0
    console = Console(width=max(Console().width, 160))
    render(events, console)
    if not any(e["event"] in ("fault_injected", "error_detected", "task_end") for e in events):
        last = max((e.get("step", -1) for e in events if e["event"] == "step_end"), default=-1)
        console.print(f"task {args.task}: no fault so far, {last + 1} step(s) committed")
    return 0


def _ssl_context(cafile: str | None) -> Any:
    """A client TLS context that verifies the coordinator's certificate and host name,
    against ``cafile`` (a test CA: ``make certs``) or the system's roots."""
    import ssl

    try:
        return ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"--ca-file {cafile}: {exc}") from None


def write_stdout(text: str) -> None:
    sys.stdout.write(text)
