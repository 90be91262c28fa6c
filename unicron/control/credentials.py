"""Who may call the cluster service: the admin token, user and agent credentials, roles.

Three roles (docs/security.md):

=======  ========================================================================
admin    everything; the token of ``STATE_DIR/token`` (or ``--token-file``, ``$UNICRON_TOKEN``)
user     submit tasks, read every task and node, cancel only the tasks it submitted
agent    register, heartbeat and exchange as the one node it is named after, nothing else
=======  ========================================================================

User and agent credentials live in ``STATE_DIR/credentials.json`` (owner-only), one entry
per name: its role, the SHA-256 of its token (the token itself is printed once, by
``unicron token add``, and never stored) and an optional expiry. The service re-reads the
file, and the admin token file, whenever they change: adding, revoking or rotating a
credential (``unicron token add`` again under the same name) takes effect on the next
request, with no restart and no pause of the training. Workers hold none of these: their
agent strips the coordinator's token from their environment (:mod:`unicron.control.agent`).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from unicron.errors import UsageError

log = logging.getLogger("unicron.control.credentials")

FILE = "credentials.json"
"""in the state directory: user and agent credentials (hashes, roles, expiries)"""
Role = Literal["admin", "user", "agent"]
ROLES: tuple[Role, ...] = ("admin", "user", "agent")
TOKEN_CHARS = re.compile(r"^[!-~]{8,512}$")
"""a token: 8 to 512 printable ASCII characters, no spaces (what a Bearer header carries)"""


def check_token(token: str, where: str) -> str:
    """``token`` if it can be a bearer token, else a one-line :class:`UsageError` naming
    ``where`` it came from (empty, blank, non-ASCII, too short)."""
    if not TOKEN_CHARS.match(token):
        raise UsageError(
            f"{where}: a token must be 8 to 512 printable ASCII characters without spaces"
        )
    return token


def digest(token: bytes) -> str:
    return hashlib.sha256(token).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who made a request: ``name`` (for an agent: its node's name) and ``role``."""

    name: str
    role: Role


ADMIN = Principal("admin", "admin")


class Credentials:
    """The service's view of who holds which token. :meth:`who` is called on every request
    (by the service's door, before any body is read); it re-reads ``admin_file`` and
    ``path`` when their modification time changed (rotation without a restart)."""

    def __init__(
        self, admin_token: str, *, admin_file: Path | None = None, path: Path | None = None
    ) -> None:
        self._admin = admin_token.encode()
        self.admin_file = admin_file
        self.path = path
        self._seen: dict[Path, float] = {}
        self._by_digest: dict[str, tuple[Principal, float | None]] = {}
        self._lock = threading.Lock()
        self._reload(strict=True)

    def _changed(self, path: Path | None) -> bool:
        if path is None:
            return False
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            mtime = -1
        if self._seen.get(path) == mtime:
            return False
        self._seen[path] = mtime
        return True

    def _reload(self, *, strict: bool = False) -> None:
        if self._changed(self.admin_file):
            assert self.admin_file is not None
            try:
                token = self.admin_file.read_text(encoding="utf-8").strip()
                self._admin = check_token(token, str(self.admin_file)).encode()
            except (OSError, UsageError):
                pass  # a file being rewritten: the last good token stays
        if self._changed(self.path):
            assert self.path is not None
            try:
                entries = read_entries(self.path)
            except UsageError as exc:
                if strict:  # at start-up: the coordinator refuses to start (exit 2)
                    raise
                log.warning("%s; the credentials read before stay", exc)
                return
            self._by_digest = {
                e["sha256"]: (Principal(name, e["role"]), e.get("expires"))
                for name, e in entries.items()
            }

    def who(self, presented: bytes, now: float | None = None) -> Principal | None:
        """The holder of ``presented`` (the raw bearer value), or ``None``: unknown, or
        expired."""
        with self._lock:
            self._reload()
            if hmac.compare_digest(presented, self._admin):
                return ADMIN
            found = self._by_digest.get(digest(presented))
        if found is None:
            return None
        principal, expires = found
        if expires is not None and (time.time() if now is None else now) >= expires:
            return None
        return principal


def read_entries(path: Path) -> dict[str, dict[str, Any]]:
    """The entries of a credentials file (``{}`` if there is none); a file that is not ours
    is a one-line :class:`UsageError`."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: not a credentials file ({exc})") from None
    if not isinstance(raw, dict) or not all(
        isinstance(e, dict) and e.get("role") in ROLES and isinstance(e.get("sha256"), str)
        for e in raw.values()
    ):
        raise UsageError(f"{path}: not a credentials file (name -> {{role, sha256, expires}})")
    return raw


def write_entries(path: Path, entries: dict[str, dict[str, Any]]) -> None:
    """Atomically, owner-only."""
    write_private(path, json.dumps(entries, indent=1, sort_keys=True))


def write_private(path: Path, text: str) -> None:
    """``text`` to ``path`` atomically (a temporary name, renamed) and owner-only (0600): the
    credentials, a generated token, the store's secret and record."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


# -- ``unicron token`` ---------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("add", "revoke", "list"), help="what to do")
    p.add_argument("name", nargs="?", metavar="NAME", help="the user, or the agent's node name")
    p.add_argument("--role", choices=("user", "agent"), default="user", help="(default user)")
    p.add_argument("--expires-in", type=float, metavar="S", help="valid this many seconds")
    p.add_argument("--state-dir", required=True, metavar="DIR", help="the coordinator's state")


def main(args: argparse.Namespace) -> int:
    """``unicron token add|revoke|list``: edit the coordinator's credentials file (a running
    coordinator sees the change on its next request). ``add`` prints the new token once;
    adding a name again rotates its token (the old one stops working)."""
    from unicron.control.taskspec import NAME

    path = Path(args.state_dir) / FILE
    if not Path(args.state_dir).is_dir():
        raise UsageError(f"--state-dir {args.state_dir}: not a directory")
    entries = read_entries(path)
    if args.action == "list":
        for name, e in sorted(entries.items()):
            exp = e.get("expires")
            left = "" if exp is None else f" (expires in {exp - time.time():.0f} s)"
            print(f"{name}: {e['role']}{left}")
        return 0
    if not args.name or not re.match(NAME, args.name) or args.name == "admin":
        raise UsageError("NAME: letters, digits, '.', '_', '-' (and not 'admin')")
    if args.action == "revoke":
        if entries.pop(args.name, None) is None:
            raise UsageError(f"no credential named {args.name}")
        write_entries(path, entries)
        return 0
    if args.expires_in is not None and not args.expires_in > 0:
        raise UsageError(f"--expires-in must be > 0 seconds, got {args.expires_in}")
    token = secrets.token_urlsafe(32)
    entries[args.name] = {
        "role": args.role,
        "sha256": digest(token.encode()),
        "expires": None if args.expires_in is None else time.time() + args.expires_in,
    }
    write_entries(path, entries)
    print(token)
    return 0
