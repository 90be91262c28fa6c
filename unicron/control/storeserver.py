"""The training store's server: torch's TCPStore protocol, behind a door that checks every key.

Every task's process groups rendezvous on one store and its workers read their epochs and cast
their commit votes there (:mod:`unicron.protocol`). torch's own TCPStore server answers any
client that connects: it can list every key (``list_keys``) and read or write any of them. This
server speaks the same protocol to torch's unchanged ``TCPStore`` client (so gloo, NCCL and
the runtime's own reads and votes work as before), and admits a request only when each of
its keys lies under a **capability**: ``/CAP/UID/...``, where ``CAP`` is
:func:`capability` of the task's ``UID`` under the store's secret. The coordinator, which
holds the secret, hands each task's capability to the agents of its nodes, and they to its
workers (``UNICRON_STORE_KEY``); a client puts it in front of every key with a
``PrefixStore`` (:func:`unicron.control.store.client`). A worker of one task therefore opens
its own task's keys and no other's, and a client without a capability opens nothing.

A refused request closes its connection (the client's call fails) and is logged with the
peer's address and why: a key outside a valid capability, a command the runtime never sends
(``list_keys``, ``num_keys``, the queues, ``barrier``), an oversized key or value, a malformed
frame. The wire format (version 2.13 of the client; a test runs the client against this
server and torch's side by side, so a change of the protocol fails the suite): a command
byte, then its arguments, strings and values as a little-endian ``uint64`` length and bytes,
integers as little-endian 64-bit; the client opens with ``VALIDATE`` (a magic number) and a
``PING``. The capability travels in clear text like the keys themselves: the store's network
must not be watched by untrusted hosts (docs/security.md).

**Fencing.** A coordinator that took over a task (a standby whose lease came, or one started
again on the state) writes its *token* first, a number above every earlier coordinator's
(:data:`FENCE_KEY` under the task's capability; the cluster's generation, counted in its
state). From then on a connection that wrote a lower token for that task is refused any write
of the task's keys: a fenced leader's requests, queued in its host's kernel while its link was
cut and delivered once the link is back, long after it exited, cannot set an epoch over its
successor's (found by the cluster soak: two epochs 52, the old leader's landing after the new
leader had read 51). Clients that write no token (workers) are not fenced.

Served by :func:`serve` on an asyncio event loop (uvloop's, where installed: a dependency off
Windows), in the store's own process (:mod:`unicron.control.store`: a cluster's, or ``unicron
run``'s child); one thread runs every client, so the keys need no lock. A request is read
whole before anything changes (a frame cut off is parsed again when the rest arrives), and
a key is checked before the value behind it is read. Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import socket
import struct
from collections.abc import Callable

from unicron.protocol import STORE_MAGIC

log = logging.getLogger("unicron.store")

CAPABILITY_HEX = 32
"""hex digits of a capability (128 bits of HMAC-SHA256)"""
MAX_KEY = 4096
"""the longest key admitted (bytes): the runtime's are under 200"""
MAX_VALUE = 64 << 20
"""the largest value admitted (bytes): the runtime's are epochs, votes and gloo's addresses"""
MAX_KEYS = 4096
"""the most keys one ``check``, ``wait`` or ``multi`` request names"""

FENCE_KEY = b"coordinator-fence"
"""the key (under a task's capability) a coordinator writes its fencing token to"""

VALIDATION_MAGIC = STORE_MAGIC
"""what torch's TCPStore client sends first (its ``VALIDATE`` command)"""

# the client's commands (torch/csrc/distributed/c10d/TCPStoreBackend.hpp, QueryType)
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY = range(9)
APPEND, MULTI_GET, MULTI_SET, CANCEL_WAIT, PING = range(9, 14)
READY, NOT_READY = b"\x00", b"\x01"  # CHECK's answer
STOP_WAITING, WAIT_CANCELED = b"\x00", b"\x01"  # WAIT's and CANCEL_WAIT's


def capability(secret: bytes, uid: str) -> str:
    """The capability that opens task ``uid``'s keys on a store serving ``secret``."""
    return hmac.new(secret, uid.encode(), hashlib.sha256).hexdigest()[:CAPABILITY_HEX]


class Refused(Exception):
    """A request the door does not admit: its connection is closed (the text is logged)."""


class _Short(Exception):
    """The request is not all here yet."""


class _Cursor:
    """Reads one request's fields off what a client sent so far (:class:`_Short` when the
    request is cut off: it is read again, whole, when more arrives)."""

    def __init__(self, buf: bytearray) -> None:
        self.buf, self.at = buf, 0

    def take(self, n: int) -> bytes:
        end = self.at + n
        if end > len(self.buf):
            raise _Short
        out = bytes(self.buf[self.at : end])
        self.at = end
        return out

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def i64(self) -> int:
        return int(struct.unpack("<q", self.take(8))[0])

    def blob(self, limit: int) -> bytes:
        n = self.u64()
        if n > limit:
            raise Refused(f"a field of {n} bytes (at most {limit})")
        return self.take(n)

    def count(self) -> int:
        n = self.u64()
        if n > MAX_KEYS:
            raise Refused(f"{n} keys in one request (at most {MAX_KEYS})")
        return n


def _payload(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


class Store:
    """The keys and the pending waits, on one asyncio loop (no lock: one thread runs it)."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.data: dict[bytes, bytes] = {}
        self.waiting: dict[bytes, list[_Client]] = {}  # key -> clients waiting for it
        self._opened: set[tuple[bytes, bytes]] = set()  # (capability, uid) checked once
        self.fences: dict[bytes, int] = {}  # task uid -> the highest coordinator token written

    def admit(self, key: bytes) -> bytes:
        """``key`` if it lies under a valid capability, else :class:`Refused`."""
        if len(key) > MAX_KEY:
            raise Refused(f"a key of {len(key)} bytes (at most {MAX_KEY})")
        parts = key.split(b"/", 3)  # "", CAP, UID, rest (the client's keys start with "/")
        if len(parts) < 3 or parts[0] or len(parts[1]) != CAPABILITY_HEX or not parts[2]:
            raise Refused(f"key {key[:80]!r} is not under a task's capability")
        cap, uid = parts[1], parts[2]
        if (cap, uid) not in self._opened:
            want = capability(self.secret, uid.decode("utf-8", "replace")).encode()
            if not hmac.compare_digest(cap, want):
                raise Refused(f"key {key[:80]!r}: not the capability of task {uid[:80]!r}")
            self._opened.add((cap, uid))
        return key

    def fence(self, c: _Client, key: bytes, value: bytes) -> bool:
        """Whether ``key`` is a task's :data:`FENCE_KEY`; if so, ``c`` holds token ``value``
        for it now (:class:`Refused` if a higher one was written: a fenced coordinator)."""
        parts = key.split(b"/", 3)  # "", CAP, UID, rest (admitted: at least the first three)
        if len(parts) < 4 or parts[3] != FENCE_KEY:
            return False
        uid = parts[2]
        try:
            token = int(value)
        except ValueError:
            raise Refused(f"fence of task {uid[:80]!r}: {value[:40]!r} is not a number") from None
        if token < self.fences.get(uid, token):
            raise Refused(f"fence of task {uid[:80]!r}: token {token} after {self.fences[uid]}")
        self.fences[uid] = c.tokens[uid] = token
        return True

    def writable(self, c: _Client, key: bytes) -> bytes:
        """``key`` (admitted) if ``c`` may write it: not if ``c`` wrote a token for its task
        lower than the task's highest (:class:`Refused`)."""
        uid = key.split(b"/", 3)[2]
        token = c.tokens.get(uid)
        if token is not None and token < self.fences[uid]:
            raise Refused(f"a write of task {uid[:80]!r} by a fenced coordinator (token "
                          f"{token}, the task's {self.fences[uid]})")  # fmt: skip
        return key

    def put(self, key: bytes, value: bytes) -> None:
        self.data[key] = value
        for c in self.waiting.pop(key, ()):
            c.missing -= 1
            if c.missing == 0:
                c.waited = []
                c.send(STOP_WAITING)

    def forget(self, c: _Client) -> None:
        """Drop client ``c``'s pending wait (cancelled, or its connection closed)."""
        for key in c.waited:
            left = [w for w in self.waiting.get(key, ()) if w is not c]
            if left:
                self.waiting[key] = left
            else:
                self.waiting.pop(key, None)
        c.waited, c.missing = [], 0


class _Client(asyncio.Protocol):
    """One client's connection: its requests are read as they arrive and answered in order."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.buf = bytearray()
        self.valid = False  # the client opened with TCPStore's validation
        self.waited: list[bytes] = []  # the keys of its pending wait
        self.tokens: dict[bytes, int] = {}  # task uid -> the fencing token it wrote
        self.missing = 0  # ... still unset
        self.transport: asyncio.Transport | None = None
        self.peer: object = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream's (uvloop's own class)
        self.peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.store.forget(self)
        self.transport = None

    def send(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.buf and self.transport is not None:
            at = _Cursor(self.buf)
            try:
                self._one(at)
            except _Short:
                return
            except Refused as exc:
                log.warning("store: refused %s: %s", self.peer, exc)
                self.transport.abort()
                return
            except Exception:
                log.exception("store: a request from %s failed", self.peer)
                self.transport.abort()
                return
            del self.buf[: at.at]

    def _one(self, f: _Cursor) -> None:
        """Carry out the request at the start of the buffer and answer it (nothing is changed
        before the whole request is here: every field is read before the store is touched)."""
        (cmd,) = f.take(1)
        if not self.valid:
            if cmd != VALIDATE or struct.unpack("<I", f.take(4))[0] != VALIDATION_MAGIC:
                raise Refused("not a TCPStore client (no validation)")
            self.valid = True
            return
        store, key = self.store, self.store.admit

        def writes(k: bytes) -> bytes:
            return store.writable(self, key(k))

        if cmd == PING:
            self.send(f.take(4))  # the nonce, echoed
        elif cmd in (SET, APPEND):
            k, v = writes(f.blob(MAX_KEY)), f.blob(MAX_VALUE)
            if cmd == APPEND or not store.fence(self, k, v):
                store.put(k, store.data.get(k, b"") + v if cmd == APPEND else v)
        elif cmd == GET:
            self.send(_payload(store.data.get(key(f.blob(MAX_KEY)), b"")))
        elif cmd == ADD:
            k, n = writes(f.blob(MAX_KEY)), f.i64()
            try:
                total = int(store.data.get(k, b"0")) + n
            except ValueError:
                raise Refused(f"add to {k[:80]!r}, which holds no number") from None
            store.put(k, str(total).encode())
            self.send(struct.pack("<q", total))
        elif cmd == COMPARE_SET:
            k = writes(f.blob(MAX_KEY))
            expected, new = f.blob(MAX_VALUE), f.blob(MAX_VALUE)
            now = store.data.get(k)
            if (now is None and not expected) or (now is not None and now == expected):
                store.put(k, new)
                now = new
            self.send(_payload(expected if now is None else now))
        elif cmd in (CHECK, WAIT):
            keys = [key(f.blob(MAX_KEY)) for _ in range(f.count())]
            missing = {k for k in keys if k not in store.data}
            if cmd == CHECK:
                self.send(NOT_READY if missing else READY)
            elif not missing:
                self.send(STOP_WAITING)
            else:
                store.forget(self)  # one wait at a time per connection
                self.waited, self.missing = list(missing), len(missing)
                for k in missing:
                    store.waiting.setdefault(k, []).append(self)
        elif cmd == CANCEL_WAIT:
            store.forget(self)
            self.send(WAIT_CANCELED)
        elif cmd == DELETE_KEY:
            gone = store.data.pop(writes(f.blob(MAX_KEY)), None) is not None
            self.send(struct.pack("<q", int(gone)))
        elif cmd == MULTI_GET:
            keys = [key(f.blob(MAX_KEY)) for _ in range(f.count())]
            self.send(b"".join(_payload(store.data.get(k, b"")) for k in keys))
        elif cmd == MULTI_SET:
            pairs = [(writes(f.blob(MAX_KEY)), f.blob(MAX_VALUE)) for _ in range(f.count())]
            for k, v in pairs:
                store.put(k, v)
        else:  # list_keys, num_keys, the queues, barrier, validation again: never the runtime's
            raise Refused(f"command {cmd} is not served")


def listen(host: str, port: int = 0) -> socket.socket:
    """A socket listening on ``host`` (that address alone) and ``port``, or a free port when
    ``port`` is 0 or taken (a store started again tries its predecessor's port first: the
    workers find it there without asking)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.bind((host, 0))
    sock.listen(1024)
    return sock


STALL_S = 0.5
"""a pause of the store's event loop longer than this is logged (:func:`watch_stalls`)"""


async def watch_stalls(every_s: float = 0.1, stall_s: float = STALL_S) -> None:
    """Log each time the event loop ran nothing for ``stall_s`` or more (the store answered
    nobody meanwhile: the process was not scheduled, or a request held the loop). The soak
    with changes of degree saw every worker give up a request after 3 s at the same moment
    (``StoreLost``) while the store answers within 60 ms beside 30 CPU burners: this line in
    ``store.log`` tells a stalled store from stalled clients next time."""
    loop = asyncio.get_running_loop()
    while True:
        before = loop.time()
        await asyncio.sleep(every_s)
        if (late := loop.time() - before - every_s) >= stall_s:
            log.warning("store: the event loop stalled %.2f s (nobody was answered)", late)


async def serve(sock: socket.socket, secret: bytes, ready: Callable[[], None] | None = None,
                stop: asyncio.Event | None = None) -> None:  # fmt: skip
    """Serve the store on listening socket ``sock`` until ``stop`` is set (forever without);
    ``ready`` is called once it accepts clients."""
    store = Store(secret)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(store), sock=sock)
    watch = asyncio.create_task(watch_stalls())
    async with server:
        if ready is not None:
            ready()
        await (stop or asyncio.Event()).wait()
    watch.cancel()
