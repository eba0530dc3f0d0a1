"""Fake HTTP servers for client tests: real sockets, scripted replies, call records.

A ``FakeServer`` runs a ThreadingHTTPServer on 127.0.0.1 in a daemon thread.
Its ``reply(method, path, body, headers) -> (status, json_or_text[, headers])``
function scripts the answers; every call is recorded, and the highest number
of requests handled at once is tracked to check concurrency caps.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import pytest

Reply = Callable[[str, str, Any, dict], tuple]


class FakeServer:
    def __init__(self, reply: Reply, delay_s: float = 0.0, port: int = 0) -> None:
        self.reply = reply
        self.delay_s = delay_s
        self.calls: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                with fake._lock:
                    fake.calls.append({"method": self.command, "path": self.path, "body": body,
                                       "headers": {k.lower(): v for k, v in self.headers.items()}})
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    if fake.delay_s:
                        time.sleep(fake.delay_s)
                    out = fake.reply(self.command, self.path, body, dict(self.headers))
                finally:
                    with fake._lock:
                        fake.in_flight -= 1
                status, payload = out[0], out[1]
                extra = out[2] if len(out) > 2 else {}
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "text/plain" if isinstance(payload, str) else "application/json")
                self.send_header("content-length", str(len(data)))
                for k, v in extra.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _handle

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True  # a server may come back on the port of one that went away
            request_queue_size = 128

        self.httpd = Server(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def paths(self) -> list[str]:
        return [c["path"] for c in self.calls]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def generate_reply(text: str = "ok", ids: tuple[int, ...] = (5, 6), finish: str = "stop",
                   logprobs: bool = True, version: str = "v0") -> dict:
    """A /generate reply in SGLang's shape."""
    meta: dict[str, Any] = {"id": "r1", "finish_reason": {"type": finish}, "prompt_tokens": 3,
                            "completion_tokens": len(ids), "weight_version": version}
    if logprobs:
        meta["output_token_logprobs"] = [[-0.5 - i, t, None] for i, t in enumerate(ids)]
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


@pytest.fixture
def fake_server():
    """Factory: ``fake_server(reply, delay_s=0, port=0)`` -> a started FakeServer, closed after the test."""
    servers: list[FakeServer] = []

    def make(reply: Reply, delay_s: float = 0.0, port: int = 0) -> FakeServer:
        srv = FakeServer(reply, delay_s, port)
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.close()


@pytest.fixture
def dead_url() -> str:
    """A URL on a port that was just free: connections are refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"
