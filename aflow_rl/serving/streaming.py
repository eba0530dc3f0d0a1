"""``n > 1`` and ``stream: true`` for the embedded server's ``/generate`` and ``/v1/chat/completions``.

Reply shapes follow SGLang 0.5 (``tokenizer_manager._handle_batch_request``):

* ``/generate`` with ``sampling_params.n = k`` expands every prompt into ``k`` sequences,
  prompt-major (``[p0s0, p0s1, ..., p1s0, ...]``), each with its own id, and answers a
  list even for one prompt. The copies are admitted in one engine round, in order, so the
  first one's prefill fills the prefix cache and the others reuse it.
* ``/generate`` with ``stream: true`` answers Server-Sent Events: ``data: {json}\\n\\n`` per
  update with the *cumulative* ``text`` and ``output_ids`` so far (SGLang's default, without
  ``--incremental-streaming-output``), an ``index`` when there are several sequences, the
  complete reply as each sequence's last event, then ``data: [DONE]\\n\\n``.
* ``/v1/chat/completions`` with ``n`` gives ``choices[0..n-1]``; with ``stream`` it sends
  OpenAI's ``chat.completion.chunk`` objects (a role delta, content deltas, a final delta with
  ``finish_reason``, a usage chunk if ``stream_options.include_usage``), then ``data: [DONE]``.
* ``/v1/completions`` with ``n`` gives ``n`` choices per prompt, prompt-major, each prompt's
  tokens counted once in ``usage`` (SGLang's ``UsageProcessor``); with ``stream`` it sends
  ``text_completion`` chunks as SGLang's ``serving_completions`` does: each carries one
  sequence's id, ``choices: [{index, text: the delta, logprobs of the new tokens, finish_reason,
  matched_stop}]`` and ``usage: null``; a ``choices: []`` usage chunk if
  ``stream_options.include_usage``; then ``data: [DONE]``.

While a stop string may still complete, its possible beginning is held back, so the text a
client has received is always a prefix of the final (stop-trimmed) text.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from aflow_rl.serving.generation import Engine, GenerateRequest, GenerateResult, RequestError, SamplingParams

MAX_N = 128   # SGLang warns above 128 sequences of parallel sampling; the embedded server refuses


def _fail(message: str) -> None:
    raise RequestError(message)


def _n(value: Any, name: str) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_N:
        _fail(f"{name} must be an integer in [1, {MAX_N}], got {value!r}")
    return value


def _stream_flag(value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        _fail(f"stream must be true or false, got {value!r}")
    return value


def fans_out(body: dict, route: str) -> bool:
    """Whether a request needs this module: ``stream`` true or ``n`` other than 1."""
    if body.get("stream"):
        return True
    if route in ("chat", "completions"):
        return body.get("n") not in (None, 1)
    sp = body.get("sampling_params")
    sps = sp if isinstance(sp, list) else [sp]
    return any(isinstance(p, dict) and p.get("n") not in (None, 1) for p in sps)


def _pop_generate_n(body: dict) -> int:
    """Take ``n`` out of ``sampling_params`` (one dict, or one per prompt with the same ``n``)."""
    sp = body.get("sampling_params")
    if isinstance(sp, dict):
        sp = dict(sp)
        n = _n(sp.pop("n", None), "sampling_params.n")
        body["sampling_params"] = sp
        return n
    if isinstance(sp, list):
        clean = [dict(p) if isinstance(p, dict) else p for p in sp]
        ns = {_n(p.pop("n", None), "sampling_params.n") for p in clean if isinstance(p, dict)}
        if len(ns) > 1:
            _fail("sampling_params.n must be the same for every prompt of a batch (as SGLang)")
        body["sampling_params"] = clean
        return ns.pop() if ns else 1
    return 1


def _expand(reqs: list[GenerateRequest], n: int) -> list[GenerateRequest]:
    """``n`` copies of each request, prompt-major, each with a fresh id (SGLang's regenerate_rid)."""
    if n == 1:
        return reqs
    return [replace(r, rid=uuid.uuid4().hex) for r in reqs for _ in range(n)]


class Fanout:
    """Several engine sequences of one HTTP request; their updates arrive on an asyncio queue."""

    def __init__(self, engine: Engine, reqs: list[GenerateRequest], stream: bool):
        self.engine, self.reqs = engine, reqs
        self.results: list[Optional[GenerateResult]] = [None] * len(reqs)
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def put(event: tuple) -> None:
            loop.call_soon_threadsafe(self.queue.put_nowait, event)

        items = []
        for i, req in enumerate(reqs):
            on_token = (lambda ids, lps, tops, i=i: put((i, ids, (lps, tops), None))) if stream else None
            items.append((req, lambda res, i=i: put((i, None, None, res)), on_token))
        engine.submit_many(items)

    def abort(self) -> None:
        """Abort every sequence that has not finished (the client went away)."""
        for req, res in zip(self.reqs, self.results):
            if res is None:
                self.engine.abort(req.rid)

    async def updates(self, request: Optional[Request] = None) -> AsyncIterator[list[tuple]]:
        """Yield the newest update per sequence, ``(i, ids, (logprobs, top), result or None)``, until all finish.

        Updates that queued up meanwhile are coalesced: a slow client gets fewer, larger chunks.
        """
        left = len(self.reqs)
        while left:
            try:
                first = await asyncio.wait_for(self.queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    self.abort()
                    request = None          # keep draining: the engine delivers the aborts
                continue
            events = [first]
            while not self.queue.empty():
                events.append(self.queue.get_nowait())
            newest: dict[int, tuple] = {}
            for event in events:
                newest[event[0]] = event
                if event[3] is not None:
                    self.results[event[0]] = event[3]
                    left -= 1
            yield [newest[i] for i in sorted(newest)]

    async def wait(self, request: Request) -> list[GenerateResult]:
        async for _ in self.updates(request):
            pass
        return list(self.results)


def stream_text(engine: Engine, ids: list[int], params: SamplingParams) -> str:
    """The text of ``ids`` safe to send now: no half UTF-8 character, no possible stop-string start."""
    text = engine.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens).rstrip("\ufffd")
    hold = max((len(s) for s in params.stop), default=0) - 1
    if hold > 0 and not params.no_stop_trim:
        text = text[:max(0, len(text) - hold)]
    return text


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _FanoutStream(StreamingResponse):
    """A stream that aborts its unfinished sequences as soon as the client hangs up, and however the
    response ends.

    Starlette listens for ``http.disconnect`` while it streams only under ASGI spec < 2.4. uvicorn
    0.54 reports 2.3 for HTTP. From 2.4 on, Starlette counts on ``send`` raising once the client is
    gone, but uvicorn's httptools protocol returns quietly from a send on a lost connection. Under
    2.4, then, nothing would notice a hang-up, and the engine would generate to the end for a dead
    connection. This response therefore listens itself, whatever the spec version: a task waits on
    ``receive`` (the request body was read before the response started) and aborts the fan on
    ``http.disconnect``. The aborted sequences finish, and the event generator ends with them.
    """

    def __init__(self, fan: Fanout, content: AsyncIterator, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.fan = fan

    async def __call__(self, scope, receive, send) -> None:
        async def abort_on_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.fan.abort()

        watcher = asyncio.create_task(abort_on_disconnect())
        try:
            await super().__call__(scope, receive, send)
        finally:
            watcher.cancel()
            self.fan.abort()


async def _close(fan: Fanout, events: AsyncIterator) -> None:
    """Abort what is unfinished when a stream ends early (client disconnect cancels the generator)."""
    fan.abort()
    try:
        await events.aclose()
    except RuntimeError:   # still running: it ends with the task being cancelled
        pass


# ---- /generate -----------------------------------------------------------------------------------

async def generate(srv, request: Request, body: dict):
    """``/generate`` with ``n > 1`` and/or ``stream: true``; ``srv`` is the embedded server's state."""
    body = dict(body)
    stream = _stream_flag(body.pop("stream", None))
    n = _pop_generate_n(body)
    reqs, batch, text_lp = await srv.parse_generate(body)
    copies = _expand(reqs, n)
    lp_flags = [t for t in text_lp for _ in range(n)]
    fan = Fanout(srv.engine, copies, stream)
    if not stream:
        results = await fan.wait(request)
        out = [srv.sglang_response(r, res, t) for r, res, t in zip(copies, results, lp_flags)]
        return JSONResponse(out if batch or n > 1 else out[0])
    indexed = len(copies) > 1
    return _FanoutStream(fan, _generate_events(srv, fan, lp_flags, indexed), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def _generate_events(srv, fan: Fanout, lp_flags: list[bool], indexed: bool):
    events = fan.updates()
    try:
        async for batch in events:
            for i, ids, lps, res in batch:
                req = fan.reqs[i]
                if res is not None:
                    chunk = srv.sglang_response(req, res, lp_flags[i])
                else:
                    chunk = _partial_generate(srv, req, ids, lps, lp_flags[i])
                if indexed:
                    chunk["index"] = i
                yield sse(chunk)
        yield SSE_DONE
    finally:
        await _close(fan, events)


def _partial(req: GenerateRequest, ids: list[int], lps: tuple, text: str) -> GenerateResult:
    """A running sequence as a result-shaped object, so the reply builders serve both."""
    return GenerateResult(rid=req.rid, prompt_ids=req.input_ids, output_ids=ids, text=text,
                          finish_reason={"type": "running"}, output_logprobs=lps[0], output_top_logprobs=lps[1],
                          input_token_ids=[], input_logprobs=[], input_top_logprobs=None, weight_version="",
                          e2e_latency=0.0, queue_time=0.0)


def _text_delta(srv, req: GenerateRequest, ids: list[int], lps: tuple, res: Optional[GenerateResult],
                params: SamplingParams, sent: str) -> tuple[GenerateResult, int, str]:
    """One sequence's update in an OpenAI-style stream: (its result so far, how many output tokens
    its content covers, the text not sent yet). ``res`` is None while it runs."""
    if res is None:
        res = _partial(req, ids, lps, stream_text(srv.engine, ids, params))
        end = len(ids)
    else:
        end = srv.content_len(res, params)
    # Held-back text makes what was sent a prefix of every later text.
    return res, end, res.text[len(sent):] if res.text.startswith(sent) else ""


def _partial_generate(srv, req: GenerateRequest, ids: list[int], lps: tuple, text_lp: bool) -> dict:
    res = _partial(req, ids, lps, stream_text(srv.engine, ids, req.params))
    out = srv.sglang_response(req, res, text_lp)
    meta = out["meta_info"]
    meta["finish_reason"], meta["weight_version"] = None, srv.engine.weight_version
    for key in ("e2e_latency", "queue_time", "cached_tokens", "input_token_logprobs", "input_top_logprobs"):
        meta.pop(key, None)      # known only once the sequence finishes
    return out


# ---- /v1/chat/completions ------------------------------------------------------------------------

def chat_logprobs(srv, res: GenerateResult, params: SamplingParams, start: int = 0,
                  end: Optional[int] = None) -> dict:
    """OpenAI's ``logprobs`` object for output tokens ``[start, end)`` of ``res`` (default: the content)."""
    end = srv.content_len(res, params) if end is None else end
    content = []
    for j in range(start, end):
        tok = srv.token_str(res.output_ids[j])
        entry = {"token": tok, "logprob": res.output_logprobs[j], "bytes": list(tok.encode("utf-8")),
                 "top_logprobs": []}
        if res.output_top_logprobs:
            for lp, t in res.output_top_logprobs[j]:
                s = srv.token_str(t)
                entry["top_logprobs"].append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))})
        content.append(entry)
    return {"content": content, "refusal": None}


def chat_choice(srv, res: GenerateResult, params: SamplingParams, want_lp: bool, index: int = 0) -> dict:
    """One ``choices[]`` entry of a non-streaming chat completion."""
    return {"index": index, "message": {"role": "assistant", "content": res.text},
            "logprobs": chat_logprobs(srv, res, params) if want_lp else None,
            "finish_reason": res.finish_reason["type"], "matched_stop": res.finish_reason.get("matched")}


def _chat_usage(results: list[GenerateResult]) -> dict:
    # SGLang counts the shared prompt once for n choices.
    p = len(results[0].prompt_ids)
    c = sum(len(r.output_ids) for r in results)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def chat(srv, request: Request, body: dict, top_logprobs_max: int):
    """``/v1/chat/completions`` with ``n > 1`` and/or ``stream: true``."""
    stream = _stream_flag(body.get("stream"))
    n = _n(body.get("n"), "n")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        _fail("stream_options must be an object")
    include_usage = stream and bool(opts.get("include_usage", False))
    rest = {k: v for k, v in body.items() if k not in ("n", "stream", "stream_options")}
    ids = await srv.chat_prompt(rest.get("messages"))
    params, spec = srv.openai_params(rest, len(ids), None)
    want_lp = rest.get("logprobs") or False
    if not isinstance(want_lp, bool):
        _fail(f"logprobs must be true or false, got {want_lp!r}")
    top_n = rest.get("top_logprobs") or 0
    if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= top_logprobs_max:
        _fail(f"top_logprobs must be an integer in [0, {top_logprobs_max}], got {top_n!r}")
    grammar = await srv.compile(spec)
    reqs = [GenerateRequest(input_ids=ids, params=params, rid=f"chatcmpl-{uuid.uuid4().hex}",
                            return_logprob=want_lp, top_logprobs_num=top_n if want_lp else 0, grammar=grammar)
            for _ in range(n)]
    fan = Fanout(srv.engine, reqs, stream)
    if not stream:
        results = await fan.wait(request)
        return {"id": results[0].rid, "object": "chat.completion", "created": int(time.time()),
                "model": srv.served_model_name,
                "choices": [chat_choice(srv, res, params, want_lp, j) for j, res in enumerate(results)],
                "usage": _chat_usage(results), "metadata": {"weight_version": results[0].weight_version}}
    return _FanoutStream(fan, _chat_events(srv, fan, params, want_lp, include_usage),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def _chat_events(srv, fan: Fanout, params: SamplingParams, want_lp: bool, include_usage: bool):
    chunk_id, created = fan.reqs[0].rid, int(time.time())
    sent_text = [""] * len(fan.reqs)
    sent_tokens = [0] * len(fan.reqs)

    def chunk(choices: list, usage: Optional[dict] = None) -> bytes:
        obj = {"id": chunk_id, "object": "chat.completion.chunk", "created": created,
               "model": srv.served_model_name, "choices": choices}
        if include_usage:
            obj["usage"] = usage
        return sse(obj)

    for j in range(len(fan.reqs)):
        yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    events = fan.updates()
    try:
        async for batch in events:
            for i, ids, lps, res in batch:
                res, end, delta = _text_delta(srv, fan.reqs[i], ids, lps, res, params, sent_text[i])
                sent_text[i] += delta
                logprobs = None
                if want_lp and end > sent_tokens[i]:
                    logprobs = chat_logprobs(srv, res, params, sent_tokens[i], end)
                    sent_tokens[i] = end
                running = res.finish_reason["type"] == "running"
                if running and not delta and logprobs is None:
                    continue
                yield chunk([{"index": i, "delta": {"content": delta} if delta or running else {},
                              "logprobs": logprobs, "finish_reason": None if running else res.finish_reason["type"],
                              "matched_stop": None if running else res.finish_reason.get("matched")}])
        if include_usage:
            yield chunk([], _chat_usage(list(fan.results)))
        yield SSE_DONE
    finally:
        await _close(fan, events)


# ---- /v1/completions -----------------------------------------------------------------------------

FANOUT_KEYS = ("n", "stream", "stream_options")


def completion_logprobs(srv, res: GenerateResult, params: SamplingParams, top_n: int, start: int = 0,
                        end: Optional[int] = None, offset: int = 0) -> dict:
    """Legacy OpenAI completions ``logprobs`` for output tokens ``[start, end)`` (default: the content):
    tokens, their logprobs, top alternatives, and text offsets counted from ``offset``."""
    end = srv.content_len(res, params) if end is None else end
    tokens = [srv.token_str(t) for t in res.output_ids[start:end]]
    offsets, pos = [], offset
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    tops = (res.output_top_logprobs or [[]] * end)[start:end]
    return {"tokens": tokens, "token_logprobs": res.output_logprobs[start:end],
            "top_logprobs": [{srv.token_str(t): lp for lp, t in e} for e in tops] if top_n else None,
            "text_offset": offsets}


def completion_choice(srv, res: GenerateResult, params: SamplingParams, top_n: Optional[int], index: int) -> dict:
    """One ``choices[]`` entry of a non-streaming text completion."""
    return {"index": index, "text": res.text,
            "logprobs": None if top_n is None else completion_logprobs(srv, res, params, top_n),
            "finish_reason": res.finish_reason["type"], "matched_stop": res.finish_reason.get("matched")}


def _completion_usage(results: list, n: int) -> dict:
    # SGLang (UsageProcessor) counts each prompt once for its n choices: copies are prompt-major.
    p = sum(len(results[i].prompt_ids) for i in range(0, len(results), n))
    c = sum(len(r.output_ids) for r in results)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _include_usage(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        _fail("stream_options must be an object")
    return stream and bool(opts.get("include_usage", False))


async def completions(srv, request: Request, body: dict, reqs: list[GenerateRequest],
                      params: list[SamplingParams], top_n: Optional[int]):
    """``/v1/completions`` with ``n > 1`` and/or ``stream: true``; ``reqs`` are built from the body
    without its fan-out keys, one per prompt. Copies are prompt-major, as in SGLang."""
    stream = _stream_flag(body.get("stream"))
    n = _n(body.get("n"), "n")
    include_usage = _include_usage(body, stream)
    srv.check_top_logprobs(n * sum((top_n or 0) * p.max_new_tokens for p in params))
    copies = [replace(r, rid=f"cmpl-{uuid.uuid4().hex}") for r in reqs for _ in range(n)] if n > 1 else reqs
    copy_params = [p for p in params for _ in range(n)]
    fan = Fanout(srv.engine, copies, stream)
    if not stream:
        results = await fan.wait(request)
        return {"id": results[0].rid, "object": "text_completion", "created": int(time.time()),
                "model": srv.served_model_name,
                "choices": [completion_choice(srv, res, p, top_n, i)
                            for i, (res, p) in enumerate(zip(results, copy_params))],
                "usage": _completion_usage(results, n), "metadata": {"weight_version": results[0].weight_version}}
    return _FanoutStream(fan, _completion_events(srv, fan, copy_params, top_n, n, include_usage),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def _completion_events(srv, fan: Fanout, params: list[SamplingParams], top_n: Optional[int], n: int,
                             include_usage: bool):
    """SGLang's completion stream: one ``text_completion`` chunk per update of a sequence (its id,
    the text delta, the new tokens' logprobs), a usage chunk if asked, then ``data: [DONE]``."""
    created, k = int(time.time()), len(fan.reqs)
    sent_text, sent_tokens, sent_offset = [""] * k, [0] * k, [0] * k
    last_id = fan.reqs[0].rid
    events = fan.updates()
    try:
        async for batch in events:
            for i, ids, lps, res in batch:
                p = params[i]
                res, end, delta = _text_delta(srv, fan.reqs[i], ids, lps, res, p, sent_text[i])
                sent_text[i] += delta
                logprobs = None
                if top_n is not None and end > sent_tokens[i]:
                    logprobs = completion_logprobs(srv, res, p, top_n, sent_tokens[i], end, sent_offset[i])
                    sent_tokens[i] = end
                    sent_offset[i] += sum(len(t) for t in logprobs["tokens"])
                running = res.finish_reason["type"] == "running"
                if running and not delta and logprobs is None:
                    continue
                last_id = fan.reqs[i].rid
                choice = {"index": i, "text": delta, "logprobs": logprobs,
                          "finish_reason": None if running else res.finish_reason["type"],
                          "matched_stop": None if running else res.finish_reason.get("matched")}
                yield sse({"id": last_id, "object": "text_completion", "created": created,
                           "model": srv.served_model_name, "choices": [choice], "usage": None})
        if include_usage:
            yield sse({"id": last_id, "object": "text_completion", "created": created,
                       "model": srv.served_model_name, "choices": [],
                       "usage": _completion_usage(list(fan.results), n)})
        yield SSE_DONE
    finally:
        await _close(fan, events)
