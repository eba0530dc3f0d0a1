"""SGLang native client: ``/generate`` with token ids in and out, plus admin calls.

This is the path training uses: the orchestrator's prompt goes in as
``input_ids``; ``output_ids`` and their ``output_token_logprobs`` come back
exactly as the server sampled them (after temperature and grammar mask), so
the trainer can score the same tokens. The embedded CPU server speaks the same
protocol, so this client works against both.

    client = SGLangClient(["http://127.0.0.1:30000"])
    c = await client.generate(input_ids=ids, return_logprob=True,
                              max_new_tokens=64, temperature=1.0, json_schema=schema)
    c.output_ids, c.logprobs, c.finish_reason     # "stop" | "length" | "abort"
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aflow_rl.llm.base import Completion, FinishReason, LLMError
from aflow_rl.llm.http import Balance, HTTPResponse, HTTPTransport
from aflow_rl.llm.openai_compat import chat_completion

_log = logging.getLogger(__name__)

# Keywords of generate() that belong to the request, not to sampling_params.
_REQUEST_KEYS = ("rid", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


def schema_to_str(schema: Any) -> str:
    """SGLang wants ``json_schema`` as a JSON string; accept a dict too."""
    return schema if isinstance(schema, str) else json.dumps(schema)


def finish_reason_of(info: Any) -> FinishReason:
    """SGLang's ``meta_info.finish_reason`` (``{"type": ...}`` or a bare string) -> ours.

    A missing or unknown reason is reported as ``abort``: the answer did not end
    the way a complete one does, and the caller must not mistake it for one.
    """
    kind = info.get("type") if isinstance(info, dict) else info
    return kind if kind in ("stop", "length", "abort") else "abort"


def parse_generate_reply(reply: dict, *, prompt_ids: list[int] | None = None,
                         latency_s: float = 0.0) -> Completion:
    """Turn one ``/generate`` reply into a ``Completion``."""
    if not isinstance(reply, dict) or "meta_info" not in reply:
        raise ValueError(f"not a /generate reply: {str(reply)[:200]}")
    meta = reply["meta_info"]
    lp_rows = meta.get("output_token_logprobs")
    logprobs = [float(row[0]) for row in lp_rows] if lp_rows is not None else None
    output_ids = reply.get("output_ids")
    if output_ids is None:
        # Some SGLang versions omit output_ids; the logprob rows carry the ids too.
        output_ids = [int(row[1]) for row in lp_rows] if lp_rows is not None else []
    version = meta.get("weight_version")
    return Completion(
        text=reply.get("text", ""),
        finish_reason=finish_reason_of(meta.get("finish_reason")),
        output_ids=[int(t) for t in output_ids],
        logprobs=logprobs,
        prompt_ids=list(prompt_ids) if prompt_ids is not None else None,
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        completion_tokens=int(meta.get("completion_tokens") or len(output_ids)),
        weight_version=None if version is None else str(version),
        latency_s=latency_s,
        raw=reply,
    )


class SGLangClient:
    """Async client for SGLang's native API over one role's servers."""

    def __init__(self, urls: list[str] | str, *, timeout_s: float = 120.0, max_retries: int = 3,
                 backoff_s: float = 0.5, max_concurrency: int = 64, api_key: str | None = None,
                 model: str = "", balance: Balance = "least_in_flight") -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = HTTPTransport(urls, timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s,
                                  max_concurrency=max_concurrency, headers=headers, balance=balance)
        self.model = model or "default"  # the name SGLang's /v1 routes accept for the served model

    @property
    def base_url(self) -> str:
        return self.http.urls[0]

    @property
    def urls(self) -> list[str]:
        """The servers in rotation: every configured one except those the last weight sync
        could not reach (they would serve stale weights; see update_weights_from_disk)."""
        return self.http.live_urls

    @property
    def all_urls(self) -> list[str]:
        return self.http.urls

    # -- generation -------------------------------------------------------------

    def build_payload(self, prompt: str | None, input_ids: list[int] | None, return_logprob: bool,
                      sampling: dict[str, Any]) -> dict:
        """The ``/generate`` JSON body (exposed for tests and for logging)."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("generate: pass exactly one of prompt (text) or input_ids")
        sampling = dict(sampling)
        payload: dict[str, Any] = {"return_logprob": bool(return_logprob)}
        for key in _REQUEST_KEYS:
            if key in sampling:
                payload[key] = sampling.pop(key)
        if sampling.get("json_schema") is not None:
            sampling["json_schema"] = schema_to_str(sampling["json_schema"])
        payload["sampling_params"] = {k: v for k, v in sampling.items() if v is not None}
        if input_ids is not None:
            # A plain copy: numpy and torch ids are made ints by the encoder (http.dumps), which
            # costs nothing for the usual list of ints, unlike int() on each of hundreds of ids.
            payload["input_ids"] = list(input_ids)
        else:
            payload["text"] = prompt
        return payload

    async def generate(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                       return_logprob: bool = False, **sampling: Any) -> Completion:
        """``POST /generate``. Sampling keywords go into ``sampling_params``
        (max_new_tokens, temperature, top_p, top_k, stop, stop_token_ids,
        ignore_eos, json_schema (str or dict), regex); ``rid``,
        ``logprob_start_len`` and ``top_logprobs_num`` go at the top level."""
        payload = self.build_payload(prompt, input_ids, return_logprob, sampling)
        t0 = time.monotonic()
        reply = await self.http.post_json("/generate", payload)
        if isinstance(reply, list):  # a batched reply to a single request: take the one answer
            reply = reply[0]
        try:
            return parse_generate_reply(reply, prompt_ids=input_ids, latency_s=time.monotonic() - t0)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise LLMError(f"POST {self.base_url}/generate: unexpected reply: {exc}", url=self.base_url) from None

    async def chat(self, messages: list[dict], *, return_logprob: bool = False, **sampling: Any) -> Completion:
        """Chat through the same servers' OpenAI-compatible ``/v1/chat/completions``
        (the server applies its chat template; no token ids come back)."""
        return await chat_completion(self.http, self.model, messages, return_logprob=return_logprob,
                                     sampling=sampling)

    # -- admin (every server of the role) -----------------------------------------

    async def _on_all(self, method: str, path: str, payload: Any = None,
                      timeout_s: float | None = None) -> list[HTTPResponse]:
        return list(await asyncio.gather(*(
            self.http.request(method, path, json=payload, url=u, timeout_s=timeout_s) for u in self.urls)))

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, *,
                                       timeout_s: float | None = None) -> list[dict]:
        """Hot-swap weights on every reachable server; raise if any reports ``success: false``.

        Every configured server is tried, those out of rotation included (one
        attempt each), so a server that went away and came back gets the new
        weights and rejoins. A server that cannot be reached (connection refused,
        no answer before the deadline) is taken out of rotation with a warning:
        the run goes on with the others, and ``urls`` no longer lists it. If no
        server can be reached, or one answers with an error, this raises.
        """
        payload: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        targets = self.http.urls
        down = set(targets) - set(self.http.live_urls)
        results = await asyncio.gather(*(
            self.http.request("POST", "/update_weights_from_disk", json=payload, url=u, timeout_s=timeout_s,
                              retry=u not in down) for u in targets), return_exceptions=True)
        replies = []
        for url, res in zip(targets, results):
            if isinstance(res, LLMError) and res.status is None:
                self.http.mark_down(url)
                _log.warning("weight sync: %s is unreachable (%s); it leaves the rotation until a weight "
                             "sync reaches it again", url, res)
                continue
            if isinstance(res, BaseException):
                raise res
            reply = _json_or_text(res)
            if not (isinstance(reply, dict) and reply.get("success")):
                message = reply.get("message") if isinstance(reply, dict) else reply
                raise LLMError(f"POST {url}/update_weights_from_disk {model_path!r} failed: {message}", url=url)
            self.http.mark_down(url, False)
            replies.append(reply)
        if not replies:
            raise LLMError(f"POST /update_weights_from_disk {model_path!r}: no server reachable of {targets}",
                           url=targets[0])
        return replies

    async def flush_cache(self) -> None:
        """Drop every server's prefix cache (after a weight update, stale KV is wrong)."""
        await self._on_all("POST", "/flush_cache")

    async def abort_request(self, rid: str) -> None:
        """Abort request ``rid`` wherever it runs; its caller gets finish_reason ``abort``."""
        await self._on_all("POST", "/abort_request", {"rid": rid})

    async def get_model_info(self, url: str | None = None) -> dict:
        """``GET /get_model_info`` of one server (the first unless ``url`` is given)."""
        return await self.http.get_json("/get_model_info", url=url or self.base_url)

    async def health(self, timeout_s: float = 5.0) -> dict[str, bool]:
        """``GET /health`` on every configured server, one attempt each: ``{url: healthy}``."""
        async def probe(url: str) -> bool:
            try:
                await self.http.request("GET", "/health", url=url, timeout_s=timeout_s, retry=False)
                return True
            except LLMError:
                return False

        results = await asyncio.gather(*(probe(u) for u in self.all_urls))
        return dict(zip(self.all_urls, results))

    async def aclose(self) -> None:
        await self.http.aclose()

    # -- pause / continue (SGLang 0.5.x, for weight updates during generation) -----

    PAUSE_MODES = ("abort", "retract", "in_place")   # SGLang's PauseGenerationReqInput.mode

    async def pause_generation(self, mode: str = "abort", *, urls: list[str] | None = None,
                               timeout_s: float | None = None) -> None:
        """``POST /pause_generation {"mode": mode}`` on ``urls`` (default: every server in rotation).

        ``mode`` is SGLang's: ``abort`` (finish every request with ``abort``), ``retract`` (drop
        the running requests' KV, recomputed on continue) or ``in_place`` (they keep their KV and
        continue under whatever weights are loaded meanwhile). Every server is tried; the first
        failure is raised after all have answered.
        """
        if mode not in self.PAUSE_MODES:
            raise ValueError(f"pause_generation: mode must be one of {', '.join(self.PAUSE_MODES)}, got {mode!r}")
        await self._on_each("/pause_generation", {"mode": mode}, urls, timeout_s)

    async def continue_generation(self, *, urls: list[str] | None = None, timeout_s: float | None = None) -> None:
        """``POST /continue_generation`` on ``urls`` (default: every server in rotation), as above."""
        await self._on_each("/continue_generation", {}, urls, timeout_s)

    async def _on_each(self, path: str, payload: dict, urls: list[str] | None, timeout_s: float | None) -> None:
        targets = list(urls if urls is not None else self.urls)
        results = await asyncio.gather(*(self.http.request("POST", path, json=payload, url=u, timeout_s=timeout_s)
                                         for u in targets), return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                raise res


def _json_or_text(resp: HTTPResponse) -> Any:
    try:
        return resp.json()
    except ValueError:
        return resp.text
