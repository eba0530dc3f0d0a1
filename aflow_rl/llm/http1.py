"""A lean HTTP/1.1 client for plain-``http://`` endpoints: keep-alive connections, one exchange each at a time.

Why not aiohttp for these: on the rollout workload (hundreds of small JSON requests in flight per
worker process) aiohttp's request path (request/response objects, header merging, payload
wrapping, a write task per request) cost about twice the CPU of a bare asyncio client
(docs/benchmarks.md, "Rollout pool"). Each exchange here is one ``transport.write`` of a
pre-built head plus the body, and a small state machine over ``data_received``.

What it speaks, and no more: HTTP/1.1 requests with a ``Content-Length`` body; responses framed
by ``Content-Length``, ``Transfer-Encoding: chunked`` or the connection's end (HTTP/1.0
servers), ``1xx`` interim responses skipped, ``Connection: close`` honoured. Anything else
(https, credentials in the URL, proxies) stays on aiohttp: ``supports(url)`` says which.
Deadlines, retries and balancing are the caller's (``HTTPTransport``): an exchange that does
not finish cleanly (cancelled, timed out, malformed) closes its connection, never returns it.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import urlsplit

from multidict import CIMultiDict, CIMultiDictProxy

_MAX_HEAD = 64 * 1024          # a response head larger than this is not an HTTP server we talk to
_NO_BODY = frozenset((204, 304))


class ProtocolError(ConnectionError):
    """The server's reply was not HTTP/1.x we can read (or the connection broke mid-reply)."""


class StaleConnection(ConnectionError):
    """A reused keep-alive connection was closed by the server before any reply byte arrived."""


def supports(url: str) -> bool:
    """Plain http without credentials in the URL: what this client handles."""
    parts = urlsplit(url)
    return parts.scheme == "http" and parts.username is None and parts.password is None


class _Reply:
    """The parse state of one response."""

    __slots__ = ("status", "headers", "body", "length", "chunked", "until_close", "keep_alive")

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.body = bytearray()
        self.length = -1          # bytes of body still expected (Content-Length framing)
        self.chunked = False
        self.until_close = False
        self.keep_alive = True


def _parse_head(head: bytes, method: str) -> _Reply:
    """Status line and headers -> a _Reply with its body framing decided (RFC 9112 section 6.3)."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    r = _Reply()
    r.status = int(code)
    conn = te = ""
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ProtocolError(f"malformed header line {line[:80]!r}")
        name, value = name.strip(), value.strip()
        r.headers.append((name, value))
        low = name.lower()
        if low == "content-length":
            if not value.isdigit():
                raise ProtocolError(f"bad Content-Length {value!r}")
            r.length = int(value)
        elif low == "transfer-encoding":
            te = value.lower()
        elif low == "connection":
            conn = value.lower()
    r.keep_alive = "close" not in conn and (version != "HTTP/1.0" or "keep-alive" in conn)
    if method == "HEAD" or r.status in _NO_BODY or 100 <= r.status < 200:
        r.length = 0
    elif te:
        if not te.endswith("chunked"):
            r.until_close, r.keep_alive = True, False   # e.g. "gzip" alone: the body ends with the connection
        else:
            r.chunked, r.length = True, -1
    elif r.length < 0:
        r.until_close, r.keep_alive = True, False
    return r


class Connection(asyncio.Protocol):
    """One keep-alive connection; ``exchange`` sends a request and waits for its whole reply."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.buf = bytearray()
        self.reply: _Reply | None = None
        self.method = ""
        self.waiter: asyncio.Future | None = None
        self.got_bytes = False
        self.closed = False
        self.idle_since = 0.0
        self.chunk_left = -1      # chunked framing: bytes left in the current chunk (+2 for its CRLF)

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.buf += data
        if self.waiter is None or self.waiter.done():
            return  # bytes nobody asked for: the connection is not reused (see release)
        try:
            self._advance()
        except ProtocolError as exc:
            self.waiter.set_exception(exc)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        w = self.waiter
        if w is None or w.done():
            return
        r = self.reply
        if r is not None and r.until_close:
            w.set_result(r)
        elif not self.got_bytes:
            w.set_exception(StaleConnection("the server closed the connection before replying"))
        else:
            w.set_exception(ProtocolError(f"connection lost mid-reply{f': {exc}' if exc else ''}"))

    # -- parsing -------------------------------------------------------------------------------

    def _advance(self) -> None:
        """Consume the buffer; resolve the waiter once the whole reply is in."""
        while True:
            r = self.reply
            if r is None:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buf) > _MAX_HEAD:
                        raise ProtocolError(f"response head over {_MAX_HEAD} bytes")
                    return
                r = _parse_head(bytes(self.buf[:end]), self.method)
                del self.buf[:end + 4]
                if 100 <= r.status < 200:   # interim (100 Continue): the real reply follows
                    continue
                self.reply = r
            if r.until_close:
                r.body += self.buf
                self.buf.clear()
                return
            if r.chunked:
                if not self._chunks(r):
                    return
            else:
                if len(self.buf) < r.length:
                    return
                r.body = self.buf[:r.length]
                del self.buf[:r.length]
            self.waiter.set_result(r)
            return

    def _chunks(self, r: _Reply) -> bool:
        """Move whole chunks into the body; True once the last chunk (and trailers) arrived."""
        while True:
            if self.chunk_left < 0:
                end = self.buf.find(b"\r\n")
                if end < 0:
                    return False
                size_field = bytes(self.buf[:end]).split(b";", 1)[0].strip()
                try:
                    size = int(size_field, 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {size_field[:20]!r}") from None
                if size == 0:
                    trailers_end = self.buf.find(b"\r\n\r\n", end)   # "0\r\n" [trailers] "\r\n"
                    if trailers_end < 0:
                        return False
                    del self.buf[:trailers_end + 4]
                    return True
                del self.buf[:end + 2]
                self.chunk_left = size + 2
            if len(self.buf) < self.chunk_left:
                return False
            r.body += self.buf[:self.chunk_left - 2]
            del self.buf[:self.chunk_left]
            self.chunk_left = -1

    # -- use -----------------------------------------------------------------------------------

    async def exchange(self, method: str, head: bytes, body: bytes | None) -> _Reply:
        """Write one request (``head`` ends with the blank line) and return its parsed reply."""
        self.method, self.reply, self.got_bytes, self.chunk_left = method, None, False, -1
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(head + body if body else head)
        if self.buf:
            self._advance()
        return await self.waiter

    def reusable(self) -> bool:
        r, w = self.reply, self.waiter
        return (not self.closed and r is not None and r.keep_alive and not self.buf
                and w is not None and w.done() and not w.cancelled() and w.exception() is None)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Keep-alive connections to one ``http://host:port[/prefix]`` endpoint, for one event loop."""

    def __init__(self, base_url: str, headers: dict[str, str], keepalive_s: float) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.keepalive_s = keepalive_s
        host_header = parts.netloc
        fixed = {"Host": host_header, "Accept": "*/*", "Accept-Encoding": "identity", **headers}
        self.fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self.idle: list[Connection] = []   # LIFO: the most recently used connection is the warmest
        self.all: set[Connection] = set()

    def _head(self, method: str, path: str, body: bytes | None) -> bytes:
        size = b"" if body is None and method in ("GET", "HEAD") else b"Content-Length: %d\r\n" % len(body or b"")
        return b"%s %s HTTP/1.1\r\n%s%s\r\n" % (method.encode(), (self.prefix + path).encode(), self.fixed, size)

    async def _connect(self) -> Connection:
        _, conn = await asyncio.get_running_loop().create_connection(Connection, self.host, self.port)
        self.all.add(conn)
        return conn

    def _acquire_idle(self) -> Connection | None:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            # Bytes that arrived while idle belong to no request: such a connection is not reused.
            if not conn.closed and not conn.buf and now - conn.idle_since < self.keepalive_s:
                return conn
            self._discard(conn)
        return None

    def _discard(self, conn: Connection) -> None:
        self.all.discard(conn)
        conn.close()

    async def request(self, method: str, path: str, body: bytes | None) -> tuple[int, CIMultiDictProxy, bytes]:
        """One exchange: ``(status, headers, body)``. A reused connection that the server had
        closed meanwhile (keep-alive race) is replaced by a fresh one once, transparently."""
        head = self._head(method, path, body)
        conn = self._acquire_idle()
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect()
            try:
                r = await conn.exchange(method, head, body)
            except StaleConnection:
                self._discard(conn)
                if not reused:
                    raise
                conn, reused = None, False
                continue
            finally:
                if conn is not None and not conn.reusable():
                    self._discard(conn)
            if conn.reusable():
                conn.idle_since = time.monotonic()
                self.idle.append(conn)
            return r.status, CIMultiDictProxy(CIMultiDict(r.headers)), bytes(r.body)

    def close(self) -> None:
        """Close every connection (in the loop that owns them)."""
        for conn in list(self.all):
            conn.close()
        self.all.clear()
        self.idle.clear()

    def drop(self) -> None:
        """Close every connection of a loop that is already closed (asyncio cannot schedule
        connection_lost there, so the transport is finalised by hand; no ResourceWarning)."""
        for conn in list(self.all):
            t = conn.transport
            if t is None:
                continue
            try:
                t.close()
            except RuntimeError:           # "Event loop is closed"
                t._call_connection_lost(None)   # closes the socket; asyncio has no public way here
        self.all.clear()
        self.idle.clear()
