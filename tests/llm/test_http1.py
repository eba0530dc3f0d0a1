"""The lean HTTP/1.1 client (aflow_rl/llm/http1.py) through HTTPTransport, against scripted raw servers.

Each server is a real socket; a handler per connection reads requests and writes exactly the
bytes a test scripts, so framing (Content-Length, chunked, close-delimited), interim replies,
keep-alive reuse and the stale-connection race are exercised byte for byte.
"""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
from typing import Callable

import pytest

from aflow_rl.llm import http1
from aflow_rl.llm.base import LLMError
from aflow_rl.llm.http import HTTPTransport

OK = b'{"ok": 1}'


def read_request(sock: socket.socket, buf: bytearray) -> tuple[bytes, bytes] | None:
    """One request (head, body) from ``sock``; None when the client closed the connection."""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            return None
        buf += data
    end = buf.index(b"\r\n\r\n")
    head = bytes(buf[:end])
    size = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            size = int(value)
    while len(buf) < end + 4 + size:
        buf += sock.recv(65536)
    body = bytes(buf[end + 4:end + 4 + size])
    del buf[:end + 4 + size]
    return head, body


def reply(body: bytes = OK, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Length: %d\r\n%s\r\n%s" % (status.encode(), len(body), extra, body)


class RawServer:
    """``handler(sock, conn_no, requests)`` runs in a thread per accepted connection."""

    def __init__(self, handler: Callable[[socket.socket, int, list], None]):
        self.handler, self.requests, self.connections = handler, [], 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._run, args=(conn, self.connections), daemon=True).start()

    def _run(self, conn: socket.socket, no: int) -> None:
        with conn:
            try:
                self.handler(conn, no, self.requests)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw_server():
    servers: list[RawServer] = []

    def make(handler):
        servers.append(RawServer(handler))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def serve_each(make_reply: Callable[[bytes, bytes], bytes]):
    """A keep-alive handler answering every request on the connection with ``make_reply(head, body)``."""
    def handler(sock, no, requests):
        buf = bytearray()
        while (req := read_request(sock, buf)) is not None:
            requests.append(req)
            sock.sendall(make_reply(*req))
    return handler


def post(t: HTTPTransport, path: str = "/generate", payload=None):
    return asyncio.run(t.post_json(path, {"x": 1} if payload is None else payload))


def posts(t: HTTPTransport, n: int) -> list:
    async def go():
        return [await t.post_json("/generate", {"i": i}) for i in range(n)]
    return asyncio.run(go())


def test_keep_alive_reuses_one_connection_and_the_request_is_well_formed(raw_server):
    srv = raw_server(serve_each(lambda h, b: reply()))
    t = HTTPTransport([srv.url + "/v1"], headers={"Authorization": "Bearer k"})
    assert t.endpoints[0].lean
    assert posts(t, 3) == [{"ok": 1}] * 3
    assert srv.connections == 1
    head, body = srv.requests[0]
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert lines[0] == "POST /v1/generate HTTP/1.1"       # the base URL's path prefix is kept
    assert headers["host"] == srv.url.removeprefix("http://")
    assert headers["content-type"] == "application/json" and headers["authorization"] == "Bearer k"
    assert int(headers["content-length"]) == len(body) and body == b'{"i":0}'


def test_get_sends_no_body(raw_server):
    srv = raw_server(serve_each(lambda h, b: reply()))
    assert asyncio.run(HTTPTransport([srv.url]).get_json("/health")) == {"ok": 1}
    head, body = srv.requests[0]
    assert head.startswith(b"GET /health HTTP/1.1") and b"content-length" not in head.lower() and body == b""


def test_chunked_reply_with_extensions_and_trailers_sent_byte_by_byte(raw_server):
    payload = b'{"text": "' + b"y" * 3000 + b'"}'
    chunks = [payload[:7], payload[7:2500], payload[2500:]]
    wire = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\nX-Trailer: t\r\n\r\n")

    def handler(sock, no, requests):
        buf = bytearray()
        while (req := read_request(sock, buf)) is not None:
            requests.append(req)
            for i in range(0, len(wire), 97):     # odd-sized pieces split sizes, CRLFs and data
                sock.sendall(wire[i:i + 97])

    srv = raw_server(handler)
    t = HTTPTransport([srv.url])
    assert posts(t, 2) == [{"text": "y" * 3000}] * 2
    assert srv.connections == 1                   # a complete chunked reply leaves the connection reusable


def test_http10_reply_ended_by_close_and_interim_100(raw_server):
    def handler(sock, no, requests):
        requests.append(read_request(sock, bytearray()))
        sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n")
        sock.sendall(b'{"ok": ')
        sock.sendall(b"2}")
        sock.shutdown(socket.SHUT_WR)

    srv = raw_server(handler)
    t = HTTPTransport([srv.url])
    assert posts(t, 2) == [{"ok": 2}] * 2
    assert srv.connections == 2                   # a close-delimited reply cannot leave the connection open


def test_connection_close_header_is_honoured(raw_server):
    srv = raw_server(serve_each(lambda h, b: reply(extra=b"Connection: close\r\n")))
    assert posts(HTTPTransport([srv.url]), 3) == [{"ok": 1}] * 3
    assert srv.connections == 3


def test_stale_keep_alive_connection_is_replaced_transparently(raw_server):
    """The server closes an idle connection just as the next request arrives (the keep-alive race):
    the request goes out again on a fresh connection, without a retry's backoff or a failure."""
    def handler(sock, no, requests):
        buf = bytearray()
        req = read_request(sock, buf)
        requests.append(req)
        sock.sendall(reply())
        if read_request(sock, buf) is not None:   # read the next request, then hang up without a reply
            sock.close()

    srv = raw_server(handler)
    t = HTTPTransport([srv.url], backoff_s=5.0)
    assert posts(t, 3) == [{"ok": 1}] * 3
    assert srv.connections == 3 and t.endpoints[0].failures == 0


def test_a_fresh_connection_closed_without_reply_is_a_retried_failure(raw_server):
    def handler(sock, no, requests):
        requests.append(read_request(sock, bytearray()))
        sock.close()

    srv = raw_server(handler)
    t = HTTPTransport([srv.url], max_retries=2, backoff_s=0.01)
    with pytest.raises(LLMError, match=r"failed after 3 attempts.*closed the connection before replying") as err:
        post(t)
    assert err.value.url == srv.url and srv.connections == 3


@pytest.mark.parametrize("wire, message", [
    (b"hello there\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{\"short", "connection lost mid-reply"),
])
def test_malformed_replies_are_clear_llm_errors(raw_server, wire, message):
    def handler(sock, no, requests):
        requests.append(read_request(sock, bytearray()))
        sock.sendall(wire)
        sock.shutdown(socket.SHUT_WR)

    srv = raw_server(handler)
    with pytest.raises(LLMError, match=message):
        post(HTTPTransport([srv.url], max_retries=1, backoff_s=0.01))


def test_a_timed_out_exchange_never_returns_its_connection(raw_server):
    """The first reply comes after the deadline: its connection is closed, so the late bytes
    cannot be read as the answer to the next request."""
    import time

    def handler(sock, no, requests):
        buf = bytearray()
        while (req := read_request(sock, buf)) is not None:
            requests.append(req)
            if len(requests) == 1:
                time.sleep(0.5)
                sock.sendall(reply(b'{"late": 1}'))
            else:
                sock.sendall(reply())

    srv = raw_server(handler)
    t = HTTPTransport([srv.url], max_retries=0)

    async def go():
        with pytest.raises(LLMError, match="timed out"):
            await t.post_json("/generate", {}, timeout_s=0.2)
        return await t.post_json("/generate", {})

    assert asyncio.run(go()) == {"ok": 1}
    assert srv.connections == 2


def test_retry_after_and_statuses_come_through_the_lean_path(raw_server):
    answers = iter([reply(b"busy", "429 Too Many Requests", b"Retry-After: 0.05\r\n"), reply()])
    srv = raw_server(serve_each(lambda h, b: next(answers)))
    t = HTTPTransport([srv.url], backoff_s=0.001)
    assert post(t) == {"ok": 1} and len(srv.requests) == 2


def test_large_reply_and_concurrent_requests(raw_server):
    big = b'{"ids": [' + b",".join(b"%d" % i for i in range(200_000)) + b"]}"
    srv = raw_server(serve_each(lambda h, b: reply(big)))
    t = HTTPTransport([srv.url], max_concurrency=8)

    async def go():
        return await asyncio.gather(*(t.post_json("/generate", {}) for _ in range(16)))

    out = asyncio.run(go())
    assert all(o["ids"][-1] == 199_999 and len(o["ids"]) == 200_000 for o in out)
    assert srv.connections <= 8


def test_only_plain_http_without_credentials_takes_the_lean_path():
    assert http1.supports("http://127.0.0.1:5") and http1.supports("http://host/v1")
    assert not http1.supports("https://api.openai.com/v1")
    assert not http1.supports("http://user:pw@host:1")
    t = HTTPTransport(["http://127.0.0.1:5", "https://example.com"])
    assert [e.lean for e in t.endpoints] == [True, False]


_HAND_CLOSED_LOOP = r'''
import asyncio, gc
from aflow_rl.bench.rollout_pool import start_endpoint
from aflow_rl.llm.http import HTTPTransport

if __name__ == "__main__":              # start_endpoint spawns the server process
    url, proc = start_endpoint(0.0)     # a keep-alive server: connections stay open in the pool
    t = HTTPTransport([url])
    loop = asyncio.new_event_loop()     # closed by hand: no shutdown_asyncgens to close the pool
    async def burst():
        return await asyncio.gather(*(t.post_json("/generate", {}) for _ in range(4)))
    loop.run_until_complete(burst())
    loop.close()
    assert asyncio.run(t.post_json("/generate", {}))["output_ids"]   # a new loop drops the old pool
    gc.collect()
    proc.kill()
    print("ok")
'''


def test_pools_of_hand_closed_loops_are_dropped_without_resource_warnings(tmp_path):
    script = tmp_path / "hand_closed.py"
    script.write_text(_HAND_CLOSED_LOOP)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-X", "dev", str(script)], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=root), cwd=tmp_path)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
    assert "unclosed" not in out.stderr.lower() and "Exception ignored" not in out.stderr, out.stderr[-2000:]
