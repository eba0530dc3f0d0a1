"""Shared HTTP transport for every client: deadlines, retries, load balancing.

One ``HTTPTransport`` serves one role's base URLs. For each call it

- picks an endpoint (least requests in flight, ties broken round-robin; or
  plain round-robin), preferring a different one on a retry;
- waits for a slot under that endpoint's concurrency cap (asyncio.Semaphore);
- sends with a deadline that covers the whole call, retries and backoff
  included, so a caller pointed at a dead server fails within ``timeout_s``;
- retries connection errors, timeouts, 429 and 5xx with jittered exponential
  backoff (honouring ``Retry-After``), never other 4xx: a bad request stays bad;
- raises ``LLMError`` naming the URL and the status.

httpx connection pools and semaphores belong to one event loop. Worker
processes may run several ``asyncio.run`` calls over their life, and the
threading pool backend runs one loop per thread, so the loop-bound state is
kept per thread, created lazily and rebuilt when the running loop changes.
The concurrency cap therefore holds per event loop (per process, or per
thread under the threading backend).
"""
from __future__ import annotations

import asyncio
import ipaddress
import itertools
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from aflow_rl.llm.base import LLMError

Balance = Literal["least_in_flight", "round_robin"]

# A server's Retry-After is honoured up to this many seconds (and never past the deadline).
_MAX_BACKOFF_S = 30.0
_BODY_CHARS = 300  # how much of an error body goes into the exception message


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port`` (no trailing slash)."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("empty server URL")
    if "://" not in url:
        url = "http://" + url
    return url


def is_retryable_status(status: int) -> bool:
    """429 (rate limited) and 5xx (server trouble, incl. Anthropic's 529) are worth retrying."""
    return status == 429 or status >= 500


def backoff_delay(attempt: int, base_s: float, rng: random.Random | None = None) -> float:
    """Jittered exponential backoff: base * 2**attempt scaled by U(0.5, 1.5), capped.

    The jitter keeps many workers that failed together from retrying in lockstep.
    """
    rng = rng or random
    return min(base_s * (2 ** attempt) * (0.5 + rng.random()), _MAX_BACKOFF_S)


@dataclass
class _Endpoint:
    url: str
    in_flight: int = 0       # requests queued for or holding a slot of this endpoint
    sent: int = 0            # requests sent, for tests and stats
    failures: int = 0


@dataclass
class _LoopState:
    """Per-event-loop objects: the httpx client and one semaphore per endpoint."""

    loop: asyncio.AbstractEventLoop
    client: httpx.AsyncClient
    sems: dict[str, asyncio.Semaphore] = field(default_factory=dict)


class HTTPTransport:
    """Load-balanced, retrying JSON-over-HTTP transport for a set of base URLs."""

    def __init__(self, urls: list[str] | str, *, timeout_s: float = 120.0, max_retries: int = 3,
                 backoff_s: float = 0.5, max_concurrency: int = 64, headers: dict[str, str] | None = None,
                 balance: Balance = "least_in_flight",
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("HTTPTransport needs at least one base URL")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0 or max_concurrency < 1:
            raise ValueError("timeout_s > 0, max_retries >= 0, backoff_s >= 0 and max_concurrency >= 1 are required")
        if balance not in ("least_in_flight", "round_robin"):
            raise ValueError(f"balance must be least_in_flight or round_robin, got {balance!r}")
        self.endpoints = [_Endpoint(normalize_url(u)) for u in urls]
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_concurrency = int(max_concurrency)
        self.headers = dict(headers or {})
        self.balance = balance
        self._transport = transport  # tests inject httpx.MockTransport here
        self._rr = itertools.count()
        self._local = threading.local()  # .state: this thread's _LoopState

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]

    # -- loop-bound state ---------------------------------------------------

    def _loop_state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state: _LoopState | None = getattr(self._local, "state", None)
        if state is None or state.loop is not loop:
            # This thread's previous loop (if any) has ended; its client cannot be
            # awaited from here, so it is dropped and its sockets closed by GC.
            limits = httpx.Limits(max_connections=self.max_concurrency * len(self.endpoints),
                                  max_keepalive_connections=self.max_concurrency * len(self.endpoints))
            # Loading CA certificates costs ~0.1-0.4 s per client; plain-http endpoints
            # (every local server) never use them, so they are loaded only for https.
            tls = any(e.url.startswith("https://") for e in self.endpoints)
            client = httpx.AsyncClient(headers=self.headers, limits=limits, timeout=None, verify=tls,
                                       transport=self._transport, trust_env=False)
            state = _LoopState(loop, client, {e.url: asyncio.Semaphore(self.max_concurrency)
                                              for e in self.endpoints})
            self._local.state = state
        return state

    async def aclose(self) -> None:
        """Close the pooled connections of this thread's client (if it belongs to the running loop)."""
        state: _LoopState | None = getattr(self._local, "state", None)
        self._local.state = None
        if state is not None and state.loop is asyncio.get_running_loop():
            await state.client.aclose()

    # -- endpoint choice ------------------------------------------------------

    def _pick(self, avoid: str | None) -> _Endpoint:
        candidates = [e for e in self.endpoints if e.url != avoid] or self.endpoints
        start = next(self._rr)
        if self.balance == "round_robin":
            return candidates[start % len(candidates)]
        # Least in flight; rotating the scan start breaks ties round-robin.
        n = len(candidates)
        rotated = [candidates[(start + i) % n] for i in range(n)]
        return min(rotated, key=lambda e: e.in_flight)

    def _endpoint(self, url: str) -> _Endpoint:
        url = normalize_url(url)
        for e in self.endpoints:
            if e.url == url:
                return e
        raise ValueError(f"{url} is not one of this client's URLs {self.urls}")

    # -- requests ----------------------------------------------------------------

    async def request(self, method: str, path: str, *, json: Any = None, url: str | None = None,
                      timeout_s: float | None = None, retry: bool = True) -> httpx.Response:
        """Send one request; return the (2xx) response or raise ``LLMError``.

        ``url`` pins the call to one endpoint (admin calls on every server);
        otherwise the balancer picks. ``timeout_s`` overrides the deadline of
        this call; ``retry=False`` makes a single attempt (health probes).
        """
        start = time.monotonic()
        state = self._loop_state()
        deadline_s = self.timeout_s if timeout_s is None else float(timeout_s)
        pinned = self._endpoint(url) if url is not None else None
        attempts = 1 + (self.max_retries if retry else 0)
        tried = 0
        last_url, last_err, last_status = "", "", None

        for attempt in range(attempts):
            ep = pinned or self._pick(avoid=last_url if attempt else None)
            full = ep.url + path
            remaining = deadline_s - (time.monotonic() - start)
            if remaining <= 0:
                break
            ep.in_flight += 1
            try:
                async with state.sems[ep.url]:
                    remaining = deadline_s - (time.monotonic() - start)
                    if remaining <= 0:
                        last_url, last_err = ep.url, "no free slot before the deadline"
                        break
                    ep.sent += 1
                    tried += 1
                    # wait_for bounds the whole exchange; httpx's own timeouts are per phase.
                    resp = await asyncio.wait_for(
                        state.client.request(method, full, json=json), timeout=remaining)
            except (asyncio.TimeoutError, httpx.TimeoutException):
                ep.failures += 1
                last_url, last_err, last_status = ep.url, f"timed out after {deadline_s:g}s", None
                retry_after = None
            except httpx.TransportError as exc:
                ep.failures += 1
                last_url, last_err, last_status = ep.url, f"{type(exc).__name__}: {exc or 'connection failed'}", None
                retry_after = None
            else:
                if resp.status_code < 400:
                    return resp
                last_url, last_status = ep.url, resp.status_code
                last_err = f"HTTP {resp.status_code}: {resp.text[:_BODY_CHARS]}"
                if not is_retryable_status(resp.status_code):
                    raise LLMError(f"{method} {full} failed: {last_err}", url=ep.url, status=resp.status_code)
                ep.failures += 1
                retry_after = _retry_after_s(resp)
            finally:
                ep.in_flight -= 1

            if attempt + 1 >= attempts:
                break
            delay = backoff_delay(attempt, self.backoff_s)
            if retry_after is not None:
                delay = max(delay, min(retry_after, _MAX_BACKOFF_S))
            remaining = deadline_s - (time.monotonic() - start)
            if delay >= remaining:
                break  # the next attempt could not finish in time anyway
            await asyncio.sleep(delay)

        where = f"{method} {last_url + path if last_url else path}"
        raise LLMError(f"{where} failed after {tried} attempt{'s' * (tried > 1)} "
                       f"in {time.monotonic() - start:.1f}s: {last_err or 'deadline passed'}",
                       url=last_url, status=last_status)

    async def post_json(self, path: str, payload: Any, **kw: Any) -> Any:
        """POST JSON and decode the JSON reply."""
        resp = await self.request("POST", path, json=payload, **kw)
        return _decode(resp)

    async def get_json(self, path: str, **kw: Any) -> Any:
        """GET and decode the JSON reply."""
        resp = await self.request("GET", path, **kw)
        return _decode(resp)


def _decode(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        url = f"{resp.request.url.scheme}://{resp.request.url.netloc.decode()}"
        raise LLMError(f"{resp.request.method} {resp.request.url} returned non-JSON "
                       f"(HTTP {resp.status_code}): {resp.text[:_BODY_CHARS]!r}",
                       url=url, status=resp.status_code) from None


def _retry_after_s(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date; the exponential backoff is good enough


def is_local_url(url: str) -> bool:
    """Loopback, ``localhost`` or a private-network IP: a server we or our cluster run."""
    host = (urlsplit(normalize_url(url)).hostname or "").lower()
    if host in ("localhost", "") or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_private or ip.is_unspecified
