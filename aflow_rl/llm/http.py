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

The library is aiohttp, chosen by measurement (docs/benchmarks.md, "Rollout
pool"): on the rollout workload (hundreds of requests in flight per worker
process) httpx spent most of the worker's CPU in httpcore's connection-pool
scan, which grows with the number of connections; aiohttp's connector does
not. Its connector has no connection limit of its own (``limit=0``): the
per-endpoint semaphores below are the only cap, so there is one knob.

Plain ``http://`` endpoints (the policy servers: embedded, SGLang, a router) go through
``http1.Pool`` instead, a lean HTTP/1.1 keep-alive client that costs about half of aiohttp's
CPU per request (docs/benchmarks.md); https and URLs with credentials stay on aiohttp. Both
sit under the same deadline, retry and balancing logic here.

aiohttp sessions and semaphores belong to one event loop. Worker processes may
run several ``asyncio.run`` calls over their life, and the threading pool
backend runs one loop per thread, so the loop-bound state is kept per thread,
created lazily and rebuilt when the running loop changes. The concurrency cap
therefore holds per event loop (per process, or per thread under the threading
backend). A session is closed when its loop shuts down (``asyncio.run``'s
teardown finalises an async generator that closes it), so no "Unclosed client
session" is logged; a loop that ends some other way gets its session's
connections dropped synchronously the next time this thread needs one, or at exit.
"""
from __future__ import annotations

import asyncio
import atexit
import ipaddress
import itertools
import json as jsonlib
import random
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal, Mapping
from urllib.parse import urlsplit

import aiohttp
import orjson

import aflow_rl.llm.http1 as http1
from aflow_rl.llm.base import LLMError

Balance = Literal["least_in_flight", "round_robin"]

# A server's Retry-After is honoured up to this many seconds (and never past the deadline).
_MAX_BACKOFF_S = 30.0
_BODY_CHARS = 300  # how much of an error body goes into the exception message
# Idle keep-alive connections are dropped after this long: below the 5 s that uvicorn (the
# embedded server) and SGLang keep them, so the client never reuses one the server just closed.
_KEEPALIVE_S = 4.0


# orjson encodes and decodes the rollout's bodies (hundreds of token ids, logprob rows) 6-8x
# faster than the json module; these options keep json.dumps's leniency (int dict keys, numpy).
_ORJSON_OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def _as_json(obj: Any) -> Any:
    """orjson's hook for types it does not know: torch scalars and tensors (token ids) become
    ints and lists, so callers may pass them without converting each id first."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "__index__"):
        return obj.__index__()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def dumps(obj: Any) -> bytes:
    """JSON-encode a request body (the json module for what orjson refuses, e.g. huge ints)."""
    try:
        return orjson.dumps(obj, default=_as_json, option=_ORJSON_OPTS)
    except TypeError:
        return jsonlib.dumps(obj, default=_as_json).encode()


def loads(data: bytes) -> Any:
    """Decode a JSON reply; the json module accepts what orjson refuses (NaN, Infinity). ValueError if neither can."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return jsonlib.loads(data)


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
class HTTPResponse:
    """A finished exchange: status, headers and the whole body (read inside the deadline)."""

    method: str
    url: str           # the full URL requested
    base_url: str      # the endpoint it went to
    status_code: int
    headers: Mapping[str, str]  # case-insensitive (aiohttp's CIMultiDictProxy)
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON (ValueError when it is not)."""
        return loads(self.content)


@dataclass
class _Endpoint:
    url: str
    in_flight: int = 0       # requests queued for or holding a slot of this endpoint
    sent: int = 0            # requests sent, for tests and stats
    failures: int = 0
    down: bool = False       # out of rotation (a weight sync could not reach it): see mark_down
    lean: bool = False       # plain http: served by http1.Pool instead of aiohttp (see _send)


@dataclass(eq=False)
class _LoopState:
    """Per-event-loop objects: the aiohttp session, one semaphore per endpoint, and the
    keep-alive pools of the plain-http endpoints."""

    loop: asyncio.AbstractEventLoop
    session: aiohttp.ClientSession
    sems: dict[str, asyncio.Semaphore] = field(default_factory=dict)
    pools: dict[str, http1.Pool] = field(default_factory=dict)
    closer: Any = None  # the async generator whose finalisation closes the session


# Every state whose session is still open, held strongly: a thread that ends with its loop
# closed by hand (not by asyncio.run) must not let its session be collected unclosed.
_LIVE: set[_LoopState] = set()
_LIVE_LOCK = threading.Lock()


async def _close_at_shutdown(state: _LoopState) -> AsyncIterator[None]:
    """Suspended at its yield for the loop's life; loop.shutdown_asyncgens() runs the finally."""
    try:
        yield
    finally:
        with _LIVE_LOCK:
            _LIVE.discard(state)
        for pool in state.pools.values():
            pool.close()
        await state.session.close()


def _register(state: _LoopState) -> None:
    """Tie the session's closing to the loop's shutdown (asyncio.run calls shutdown_asyncgens).

    The generator must be iterated inside the loop to be registered with it (the
    loop's firstiter hook), hence the one-step task. States of loops that have
    closed since (closed by hand, never shut down) are dropped here.
    """
    with _LIVE_LOCK:
        dead = [s for s in _LIVE if s.loop.is_closed()]
        _LIVE.add(state)
    for old in dead:
        _drop(old)
    agen = _close_at_shutdown(state)
    state.closer = agen

    async def start() -> None:
        await agen.__anext__()

    state.loop.create_task(start())


def _drop(state: _LoopState) -> None:
    """Close a state whose loop no longer runs (or is gone), synchronously and quietly."""
    with _LIVE_LOCK:
        _LIVE.discard(state)
    for pool in state.pools.values():
        pool.drop()
    if state.closer is not None:
        # Finish the generator here: were it garbage-collected unfinished, its finaliser
        # would try to schedule aclose() on a closed loop. session.close() does not
        # suspend when the loop is closed, so one send() runs it to the end.
        coro, state.closer = state.closer.aclose(), None
        try:
            coro.send(None)
        except (StopIteration, RuntimeError, GeneratorExit):
            pass
        else:
            coro.close()
    if not state.session.closed and state.session.connector is not None:
        with warnings.catch_warnings():  # "close() is a coroutine": there is no loop left to await it on
            warnings.simplefilter("ignore", DeprecationWarning)
            waiter = state.session.connector.close()
            del waiter


@atexit.register
def _drop_all() -> None:
    with _LIVE_LOCK:
        states = list(_LIVE)
    for state in states:
        if not state.loop.is_running():
            _drop(state)


class HTTPTransport:
    """Load-balanced, retrying JSON-over-HTTP transport for a set of base URLs."""

    def __init__(self, urls: list[str] | str, *, timeout_s: float = 120.0, max_retries: int = 3,
                 backoff_s: float = 0.5, max_concurrency: int = 64, headers: dict[str, str] | None = None,
                 balance: Balance = "least_in_flight") -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("HTTPTransport needs at least one base URL")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0 or max_concurrency < 1:
            raise ValueError("timeout_s > 0, max_retries >= 0, backoff_s >= 0 and max_concurrency >= 1 are required")
        if balance not in ("least_in_flight", "round_robin"):
            raise ValueError(f"balance must be least_in_flight or round_robin, got {balance!r}")
        self.endpoints = [_Endpoint(normalize_url(u)) for u in urls]
        for e in self.endpoints:
            e.lean = http1.supports(e.url)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_concurrency = int(max_concurrency)
        self.headers = dict(headers or {})
        self.balance = balance
        self._rr = itertools.count()
        self._local = threading.local()  # .state: this thread's _LoopState

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]

    @property
    def live_urls(self) -> list[str]:
        """The endpoints in rotation: all but those marked down."""
        return [e.url for e in self.endpoints if not e.down]

    def mark_down(self, url: str, down: bool = True) -> None:
        """Take ``url`` out of the balancer's rotation (or put it back). While every endpoint
        is down the balancer uses them all: failing loudly beats having nowhere to send."""
        self._endpoint(url).down = down

    # -- loop-bound state ---------------------------------------------------

    def _loop_state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state: _LoopState | None = getattr(self._local, "state", None)
        if state is None or state.loop is not loop:
            if state is not None:
                _drop(state)  # this thread's previous loop has ended; its session cannot be awaited here
            # limit=0: no connector-wide cap, the per-endpoint semaphores are the cap.
            # ttl_dns_cache: a cluster's server names are resolved once a minute, not per connection.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=60,
                                             keepalive_timeout=_KEEPALIVE_S)
            # Content-Type at session level: every body is JSON, and per-call headers cost a merge.
            # No cookies: the servers set none, and the jar costs work on every request.
            session = aiohttp.ClientSession(headers=_with_json_type(self.headers),
                                            connector=connector, trust_env=False,
                                            cookie_jar=aiohttp.DummyCookieJar(),
                                            timeout=aiohttp.ClientTimeout(total=None), raise_for_status=False)
            headers = _with_json_type(self.headers)
            state = _LoopState(loop, session, {e.url: asyncio.Semaphore(self.max_concurrency)
                                               for e in self.endpoints},
                               {e.url: http1.Pool(e.url, headers, _KEEPALIVE_S) for e in self.endpoints if e.lean})
            _register(state)
            self._local.state = state
        return state

    async def aclose(self) -> None:
        """Close this thread's session (if it belongs to the running loop)."""
        state: _LoopState | None = getattr(self._local, "state", None)
        self._local.state = None
        if state is None:
            return
        if state.loop is asyncio.get_running_loop():
            with _LIVE_LOCK:
                _LIVE.discard(state)
            for pool in state.pools.values():
                pool.close()
            await state.session.close()
        else:
            _drop(state)

    # -- endpoint choice ------------------------------------------------------

    def _pick(self, avoid: str | None) -> _Endpoint:
        if len(self.endpoints) == 1:
            return self.endpoints[0]
        pool = [e for e in self.endpoints if not e.down] or self.endpoints
        candidates = [e for e in pool if e.url != avoid] or pool
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

    async def _send(self, state: _LoopState, method: str, ep: _Endpoint, path: str, body: bytes | None,
                    remaining: float) -> HTTPResponse:
        """One exchange, body read included, bounded by ``remaining`` seconds."""
        # asyncio.timeout bounds the whole exchange with one timer (aiohttp's own
        # ClientTimeout rounds deadlines over 5 s up to the next whole second).
        if ep.lean:
            async with asyncio.timeout(remaining):
                status, headers, content = await state.pools[ep.url].request(method, path, body)
            return HTTPResponse(method, ep.url + path, ep.url, status, headers, content)
        async with asyncio.timeout(remaining):
            async with state.session.request(method, ep.url + path, data=body) as resp:
                content = await resp.read()
        return HTTPResponse(method, ep.url + path, ep.url, resp.status, resp.headers, content)

    async def request(self, method: str, path: str, *, json: Any = None, url: str | None = None,
                      timeout_s: float | None = None, retry: bool = True) -> HTTPResponse:
        """Send one request; return the (2xx) response or raise ``LLMError``.

        ``url`` pins the call to one endpoint (admin calls on every server);
        otherwise the balancer picks. ``timeout_s`` overrides the deadline of
        this call; ``retry=False`` makes a single attempt (health probes).
        """
        start = time.monotonic()
        state = self._loop_state()
        deadline_s = self.timeout_s if timeout_s is None else float(timeout_s)
        pinned = self._endpoint(url) if url is not None else None
        body = None if json is None else dumps(json)  # encoded once for every attempt
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
                    resp = await self._send(state, method, ep, path, body, remaining)
            except asyncio.TimeoutError:
                ep.failures += 1
                last_url, last_err, last_status = ep.url, f"timed out after {deadline_s:g}s", None
                retry_after = None
            except (aiohttp.ClientError, OSError) as exc:
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


def _with_json_type(headers: dict[str, str]) -> dict[str, str]:
    if any(k.lower() == "content-type" for k in headers):
        return dict(headers)
    return {**headers, "Content-Type": "application/json"}


def _decode(resp: HTTPResponse) -> Any:
    try:
        return resp.json()
    except ValueError:
        raise LLMError(f"{resp.method} {resp.url} returned non-JSON "
                       f"(HTTP {resp.status_code}): {resp.text[:_BODY_CHARS]!r}",
                       url=resp.base_url, status=resp.status_code) from None


def _retry_after_s(resp: HTTPResponse) -> float | None:
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
