"""What keeps one request from harming the embedded server or the other requests on it.

- :class:`Limits`: bounds on what one request may cost (body bytes, prompts per batch,
  top-logprob entries, prompt text before tokenizing, grammar compile time), set from the
  server's command line with safe defaults.
- :func:`read_json_body`: the body read with a byte cap, parsed to a JSON object; every
  malformed body (bad UTF-8, 5000-digit integers, deep nesting) is a 400, never a 500.
- :class:`ApiKeyMiddleware`: SGLang's ``--api-key`` / ``--admin-api-key`` rules
  (``sglang/srt/utils/auth.py: decide_request_auth``): with a key set, every route but
  ``/health*`` needs ``Authorization: Bearer <key>``; the admin routes (weight updates,
  cache flush, abort, pause/continue) need the admin key when one is set.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse


class TooLarge(ValueError):
    """A request over a configured limit (HTTP 413)."""


class BadBody(ValueError):
    """A body that is not a JSON object (HTTP 400)."""


@dataclass(frozen=True)
class Limits:
    """Per-request bounds; each default leaves every legitimate request of a 2k-32k context model through."""

    max_request_bytes: int = 32 * 1024 * 1024      # a 32k-token prompt is ~0.2 MB; token-id lists ~0.4 MB
    max_batch_prompts: int = 4096                   # prompts (or choices) in one /generate or /v1/completions
    max_top_logprobs_entries: int = 1_000_000      # top_logprobs_num x logprob positions (~30 MB of JSON)
    grammar_compile_timeout_s: float = 30.0         # a request waits this long for its grammar, then gets 400
    max_concurrent_compiles: int = 2                # compiles that may run at once (each holds a thread)


def prompt_bytes_bound(tokenizer, context_length: int) -> int:
    """Most UTF-8 bytes a text can have and still fit ``context_length`` tokens.

    A token stands for at most ``L`` bytes of text (``L`` the longest token string's UTF-8
    length, an over-estimate for byte-level vocabularies), so a text of more than
    ``context_length * L`` bytes has more than ``context_length`` tokens; the factor 2
    covers normalizers that shrink text (NFC composition). Longer texts are refused
    before tokenizing: a 4 MB prompt took 54 s to tokenize on 2 cores only to be refused.
    """
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    longest = max((len(t.encode("utf-8")) for t in tokens if isinstance(t, str)), default=16)
    return 2 * context_length * max(longest, 1)


async def read_json_body(request: Request, max_bytes: int) -> dict:
    """The request's JSON object, read with a cap of ``max_bytes``.

    Raises :class:`TooLarge` over the cap (checked on Content-Length first, then while
    streaming) and :class:`BadBody` for anything that is not one JSON object.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise TooLarge(f"request body of {int(declared)} bytes is over the server's limit of {max_bytes} "
                       f"(--max-request-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise TooLarge(f"request body is over the server's limit of {max_bytes} bytes (--max-request-bytes)")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw or b"null")
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError, bad UTF-8 and Python's 4300-digit limit on integers;
        # RecursionError deeply nested arrays. Either would otherwise be a 500 and a reset connection.
        raise BadBody(f"malformed JSON body: {str(exc)[:200]}") from exc
    if not isinstance(body, dict):
        raise BadBody("the request body must be a JSON object")
    return body


# ---- API keys (SGLang's rules) ---------------------------------------------------------------------------

ADMIN_PATHS = frozenset({"/update_weights_from_disk", "/flush_cache", "/abort_request", "/pause_generation",
                         "/continue_generation", "/init_weights_update_group", "/update_weights_from_distributed",
                         "/begin_weight_update", "/end_weight_update", "/destroy_weights_update_group"})


def _bearer_ok(header: Optional[str], expected: str) -> bool:
    if not header:
        return False
    parts = header.split(" ", 1)
    return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], expected)


def allowed(method: str, path: str, authorization: Optional[str], api_key: Optional[str],
            admin_api_key: Optional[str]) -> bool:
    """SGLang's decide_request_auth for the NORMAL and ADMIN_OPTIONAL levels this server has."""
    if method == "OPTIONS" or path.startswith("/health"):
        return True                                 # probes work without secrets, as in SGLang
    if path in ADMIN_PATHS:
        key = admin_api_key or api_key
        return key is None or _bearer_ok(authorization, key)
    return api_key is None or _bearer_ok(authorization, api_key)


class ApiKeyMiddleware:
    """Pure ASGI (like SGLang's) so a client's disconnect still reaches the route."""

    def __init__(self, app, api_key: Optional[str] = None, admin_api_key: Optional[str] = None):
        self.app, self.api_key, self.admin_api_key = app, api_key or None, admin_api_key or None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (self.api_key or self.admin_api_key):
            headers = dict(scope.get("headers") or [])
            authz = headers.get(b"authorization")
            if not allowed(scope["method"], scope["path"], authz.decode("latin-1") if authz else None,
                           self.api_key, self.admin_api_key):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
