"""Leadership among coordinators of one state directory: a lease in etcd.

``unicron coordinator --etcd URL`` on two (or more) machines that see the same state directory
(a shared file system, as Slurm's controllers share their ``StateSaveLocation``): each
campaigns for the key ``/unicron/<name>/leader`` (:class:`Leadership`), which only a holder of
a live etcd lease can create; the one that does is the coordinator, the others wait as
standbys, serving nothing, until the key is gone (the leader's lease expired: its host lost,
its process killed, its network cut) and one of them creates it again. The leader renews its
lease every quarter of its time to live; one that has not renewed it for the time to live
less a margin fences itself (it exits at once, before the lease can expire in etcd and a standby
take over): two coordinators never act on the state at once, whatever the network does.

The client speaks etcd's v3 JSON gateway (``/v3/kv/txn``, ``/v3/lease/grant``, ...) with
httpx: no gRPC stack for four calls. etcd itself comes from the distribution's packages
(``apt-get install etcd-server``). docs/cluster.md, A standby coordinator.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("unicron.control.lease")

TTL_S = 2.0
"""the leader lease's time to live: a lost leader is replaced this long after its last renewal
(etcd's own minimum, with its default election timeout, is about 1.5 s)"""
FENCE_MARGIN_S = 0.5
"""a leader exits when its lease has gone unrenewed for ``TTL_S`` less this margin and a
request's timeout (etcd keeps the lease at least ``TTL_S`` after the last renewal it
acknowledged, which this leader sent no earlier than it counts from)"""
FENCED_EXIT = 75
"""the exit code of a leader that fenced itself"""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Etcd:
    """The calls of etcd's v3 JSON gateway that a lease needs (``url``: one client URL)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        import httpx

        self._http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, trust_env=False)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self._http.post(path, json=body)
        r.raise_for_status()
        return dict(r.json())

    def grant(self, ttl_s: float) -> str:
        """A new lease of ``ttl_s`` (rounded up to whole seconds); its id."""
        return str(self._post("/v3/lease/grant", {"TTL": str(max(1, round(ttl_s + 0.49)))})["ID"])

    def keepalive(self, lease: str) -> bool:
        """Renew ``lease``; False once it has expired."""
        got = self._post("/v3/lease/keepalive", {"ID": lease}).get("result", {})
        return int(got.get("TTL", 0)) > 0

    def create(self, key: str, value: str, lease: str) -> bool:
        """Put ``key`` = ``value`` under ``lease`` if no such key exists; whether it did."""
        txn = {
            "compare": [{"key": _b64(key), "target": "CREATE", "create_revision": "0"}],
            "success": [{"requestPut": {"key": _b64(key), "value": _b64(value), "lease": lease}}],
        }
        return bool(self._post("/v3/kv/txn", txn).get("succeeded", False))

    def get(self, key: str) -> str | None:
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return base64.b64decode(kvs[0]["value"]).decode() if kvs else None

    def revoke(self, lease: str) -> None:
        self._post("/v3/lease/revoke", {"ID": lease})

    def close(self) -> None:
        self._http.close()


class Leadership:
    """One coordinator's campaign for the lead of ``name`` (see the module docstring): it
    blocks in :meth:`acquire` until it leads, then :meth:`hold` renews the lease in a thread
    and calls ``on_lost`` (by default: exit :data:`FENCED_EXIT`) if it cannot. ``me``: what
    the key holds while this coordinator leads (its URL, for whoever asks)."""

    def __init__(self, url: str, name: str, me: str, *, ttl_s: float = TTL_S) -> None:
        self.key = f"/unicron/{name}/leader"
        self.me, self.ttl_s = me, ttl_s
        self.request_s = ttl_s / 8  # etcd answers in milliseconds on a healthy network
        self.etcd = Etcd(url, timeout_s=self.request_s)
        self.lease = ""
        self.renewed = 0.0  # when the last acknowledged renewal was sent (monotonic)
        self._stop = threading.Event()

    def acquire(self, stop: threading.Event | None = None, poll_s: float = 0.1) -> bool:
        """Block until this coordinator leads (True) or ``stop`` is set (False). Errors
        reaching etcd are retried: a standby waits for etcd as for the leader."""
        said = False
        while stop is None or not stop.is_set():
            sent = time.monotonic()
            try:
                if not self.lease or not self.etcd.keepalive(self.lease):
                    self.lease = self.etcd.grant(self.ttl_s)
                if self.etcd.create(self.key, self.me, self.lease):
                    self.renewed = sent
                    log.warning("leading %s as %s", self.key, self.me)
                    return True
                if not said:
                    log.warning("standby: %s leads %s", self.etcd.get(self.key), self.key)
                    said = True
            except Exception as exc:  # etcd away: wait for it as for the leader
                log.warning("etcd: %s", exc)
            time.sleep(poll_s)
        return False

    def hold(self, on_lost: Callable[[], None] | None = None) -> threading.Thread:
        """Renew the lease every quarter of its time to live, in a thread; ``on_lost``
        (default: exit) once the lease is gone, or before it could lapse unrenewed: at the
        time to live after the last acknowledged renewal was sent, less the fence margin
        and a request's timeout (a renewal in flight then could not help)."""
        lost = on_lost or _fence

        def renew() -> None:
            while True:
                deadline = self.renewed + self.ttl_s - FENCE_MARGIN_S - self.request_s
                now = time.monotonic()
                if now >= deadline:
                    log.error("the leader lease went unrenewed for %.1f s", now - self.renewed)
                    lost()
                    return
                if self._stop.wait(min(self.ttl_s / 4, deadline - now)):
                    return
                if time.monotonic() >= deadline:
                    continue
                sent = time.monotonic()
                try:
                    if not self.etcd.keepalive(self.lease):
                        log.error("the leader lease expired")
                        lost()
                        return
                    self.renewed = sent
                except Exception as exc:
                    log.warning("renewing the leader lease: %s", exc)

        thread = threading.Thread(target=renew, name="leader-lease", daemon=True)
        thread.start()
        return thread

    def resign(self) -> None:
        """Give the lead up now (a clean shutdown: a standby takes over at once)."""
        self._stop.set()
        try:
            if self.lease:
                self.etcd.revoke(self.lease)
        except Exception as exc:
            log.warning("resigning: %s", exc)
        self.etcd.close()


def _fence() -> None:
    """Stop acting at once: a standby may lead from the lease's expiry on."""
    log.error("fenced: exiting so that no two coordinators act on the state")
    os._exit(FENCED_EXIT)
