"""The embedded inference server (CPU, or one GPU with ``--device cuda``): SGLang's HTTP API over :class:`~aflow_rl.serving.generation.Engine`.

    python -m aflow_rl.serving.embedded --model-path DIR --port P [--host 127.0.0.1]
        [--max-batch-size N] [--context-length N] [--dtype auto|float32|bfloat16]
        [--threads N] [--device cpu|cuda|cuda:N] [--served-model-name NAME] [--api-key K] [--admin-api-key K]
        [--max-request-bytes B] [--max-batch-prompts N] [--max-top-logprobs-entries N]
        [--grammar-compile-timeout S] [--http auto|h11|httptools] [--loop auto|asyncio|uvloop]

The process loads the model before it listens, so ``GET /health`` answers 200 only
once it can serve (503 if the engine thread has died). Routes, with SGLang's JSON
shapes: ``/generate`` (single or batched, ``text`` or ``input_ids``), ``/health``,
``/health_generate``, ``/get_model_info``, ``/get_server_info``,
``/update_weights_from_disk``, ``/flush_cache``, ``/abort_request``,
``/pause_generation``, ``/continue_generation``, the distributed weight sync
(``/init_weights_update_group`` and the rest: serving/dist_routes.py), and the
OpenAI-compatible ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.
Bad input gets HTTP 400 with ``{"error": {"message", "type", "code"}}`` (413 for a body
over the limit). Request checks follow SGLang (serving/contract.py); limits and API keys
are in serving/guard.py; docs/security.md says what the server exposes.
"""
from __future__ import annotations

import os

# Must precede the first `import torch` of the process. With the default (active) policy,
# idle OpenMP threads spin, and on a small shared CPU box a 2-thread decode step of the
# tiny model measured 77 ms instead of 2.6 ms while other processes were busy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from aflow_rl.serving.generation import (PAUSE_MODES, Engine, GenerateRequest, GenerateResult, RequestError,
                                         SamplingParams)
from aflow_rl.serving.contract import (MAX_STOP_COUNT, ContractError, as_bool, as_float, as_int,
                                      check_generate_fields, check_sampling_keys, fail, stop_regexes, str_list,
                                      top_k)
from aflow_rl.serving.dist_routes import add_distributed_routes
from aflow_rl.serving.grammar import GrammarError, spec_from_params
from aflow_rl.serving.guard import ApiKeyMiddleware, BadBody, Limits, TooLarge, prompt_bytes_bound, read_json_body
from aflow_rl.serving import streaming

log = logging.getLogger("aflow_rl.serving.embedded")

SERVER_VERSION = "aflow_rl-embedded-0.1"
API_KEY_ENV = "AFLOW_SERVER_API_KEY"               # read by --api-key's default (and by weight_sync)
ADMIN_API_KEY_ENV = "AFLOW_SERVER_ADMIN_API_KEY"
DEFAULT_MAX_NEW_TOKENS = 128          # SGLang's default for /generate
MAX_TOP_LOGPROBS = 20                 # OpenAI's limit; /generate allows up to the vocabulary


# ---- validation helpers (SGLang's contract: aflow_rl/serving/contract.py) -------------------------------

_fail, _int, _float, _bool = fail, as_int, as_float, as_bool


def _token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not value:
        _fail(f"{name} must be a non-empty list of token ids")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            _fail(f"{name} must contain integers, got {t!r}")
        if not 0 <= t < vocab_size:
            _fail(f"{name} contains token id {t} outside the vocabulary [0, {vocab_size})")
    return list(value)


async def _json_body(request: Request) -> dict:
    return await read_json_body(request, request.app.state.server.limits.max_request_bytes)


def _error(status: int, message: str, err_type: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "code": status}, "object": "error"},
                        status_code=status)


# ---- request parsing ---------------------------------------------------------------------------

class _Server:
    """Per-app state: the engine plus the protocol glue around it."""

    def __init__(self, engine: Engine, served_model_name: str, host: str = "127.0.0.1", port: int = 0,
                 limits: Limits = Limits()):
        self.engine = engine
        self.served_model_name = served_model_name
        self.host, self.port = host, port
        self.limits = limits
        self.started = time.time()
        self.max_prompt_bytes = prompt_bytes_bound(engine.tokenizer, engine.context_length)
        self._compile_slots = asyncio.Semaphore(limits.max_concurrent_compiles)
        self._compiling: dict[Any, asyncio.Future] = {}    # spec -> its running compile, shared by repeats

    def check_text_size(self, texts: list[str], what: str) -> None:
        """Refuse, before tokenizing, texts that together cannot fit the context (guard.prompt_bytes_bound)."""
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if size > self.max_prompt_bytes:
            _fail(f"the {what} has {size} bytes; more than {self.max_prompt_bytes} bytes cannot fit the "
                  f"model's context length of {self.engine.context_length} tokens")

    async def encode(self, texts: list[str], what: str = "text", **kwargs) -> list[list[int]]:
        """Tokenize off the event loop, refusing first any text too long to fit the context."""
        for t in texts:
            self.check_text_size([t], what)
        tok = self.engine.tokenizer
        return await asyncio.to_thread(lambda: [tok.encode(t, **kwargs) for t in texts])

    # -- sampling params --

    def sampling_params(self, raw: Any, prompt_len: int, default_max: Optional[int]) -> tuple[SamplingParams, Any]:
        """Validate SGLang sampling params as SGLang does; returns them and the grammar spec (or None)."""
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            _fail("sampling_params must be a JSON object")
        check_sampling_keys(raw)

        def get(key: str, default: Any) -> Any:   # SGLang treats an explicit null as "unset"
            value = raw.get(key)
            return default if value is None else value

        max_new = self.max_new_tokens(raw.get("max_new_tokens"), prompt_len, default_max)
        stop_ids = get("stop_token_ids", [])
        if not isinstance(stop_ids, list):
            _fail("stop_token_ids must be a list of token ids")
        regexes, regex_len = stop_regexes(raw.get("stop_regex"))
        params = SamplingParams(
            max_new_tokens=max_new,
            temperature=_float(get("temperature", 1.0), "temperature", lo=0.0),
            top_p=_float(get("top_p", 1.0), "top_p", lo=0.0, hi=1.0, lo_open=True),
            top_k=top_k(get("top_k", -1), self.engine.vocab_size),
            stop=str_list(raw.get("stop"), "stop", MAX_STOP_COUNT),
            stop_token_ids=[_int(t, "stop_token_ids[]", 0, self.engine.vocab_size - 1) for t in stop_ids],
            ignore_eos=_bool(get("ignore_eos", False), "ignore_eos"),
            skip_special_tokens=_bool(get("skip_special_tokens", True), "skip_special_tokens"),
            no_stop_trim=_bool(get("no_stop_trim", False), "no_stop_trim"),
            sampling_seed=None if raw.get("sampling_seed") is None else _int(raw["sampling_seed"], "sampling_seed"),
            stop_regex=regexes, stop_regex_max_len=regex_len,
        )
        _bool(get("spaces_between_special_tokens", True), "spaces_between_special_tokens")
        return params, spec_from_params(raw)

    def max_new_tokens(self, value: Any, prompt_len: int, default_max: Optional[int]) -> int:
        """The output budget: the request's (checked against the context) or what the context leaves."""
        ctx = self.engine.context_length
        if prompt_len >= ctx:
            _fail(f"the prompt has {prompt_len} tokens; the model's context length is {ctx}")
        if value is None:
            return min(default_max if default_max is not None else ctx, ctx - prompt_len)
        max_new = _int(value, "max_new_tokens", lo=0)
        if prompt_len + max_new > ctx:
            _fail(f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                  f"You requested a total of {prompt_len + max_new} tokens: {prompt_len} tokens from the "
                  f"input and {max_new} tokens for the completion.")
        return max_new

    async def compile(self, spec) -> Any:
        """Compile a grammar spec off the event loop within the compile deadline; GrammarError -> 400.

        xgrammar cannot be interrupted, so a compile past the deadline runs on in its thread and
        keeps its slot until it ends: at most ``max_concurrent_compiles`` threads ever compile,
        and a repeat of a spec still compiling waits for that one instead of starting another.
        """
        if spec is None:
            return None
        backend = self.engine.grammar
        compiled = backend.cache.get(spec)
        if compiled is not None:
            return compiled
        timeout = self.limits.grammar_compile_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(self._compile_future(spec)), timeout)
        except asyncio.TimeoutError:
            _fail(f"the {spec.kind} did not compile within {timeout:g} s (--grammar-compile-timeout); "
                  f"simplify it")

    def _compile_future(self, spec) -> asyncio.Future:
        fut = self._compiling.get(spec)
        if fut is None:
            fut = asyncio.ensure_future(self._compile_in_slot(spec))
            self._compiling[spec] = fut
            fut.add_done_callback(lambda _: self._compiling.pop(spec, None))
        return fut

    async def _compile_in_slot(self, spec) -> Any:
        backend = self.engine.grammar
        async with self._compile_slots:
            compiled = await asyncio.to_thread(backend.compile_uncached, spec)
        backend.cache.put(spec, compiled)
        return compiled

    # -- /generate --

    async def parse_generate(self, body: dict) -> tuple[list[GenerateRequest], bool, list[bool]]:
        """SGLang's GenerateReqInput -> engine requests, whether it was a batch, return_text flags."""
        if body.get("stream"):
            _fail("stream=true is not supported by the embedded server")
        check_generate_fields(body)
        text, input_ids = body.get("text"), body.get("input_ids")
        if text is not None and input_ids is not None:
            _fail("Either text or input_ids should be provided, not both.")
        if text is None and input_ids is None:
            _fail("Either text or input_ids should be provided.")
        vocab = self.engine.vocab_size
        if text is not None:
            if isinstance(text, str):
                prompts, batch = [text], False
            elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                prompts, batch = text, True
            else:
                _fail("text must be a string or a non-empty list of strings")
            self.check_batch(len(prompts))
            ids_list = await self.encode(prompts)
            for t, ids in zip(prompts, ids_list):
                if not ids:
                    _fail(f"text {t!r} encodes to no tokens")
        else:
            if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
                self.check_batch(len(input_ids))
                ids_list = [_token_ids(x, f"input_ids[{i}]", vocab) for i, x in enumerate(input_ids)]
                batch = True
            else:
                ids_list, batch = [_token_ids(input_ids, "input_ids", vocab)], False
        n = len(ids_list)

        def per_item(key: str, default: Any) -> list:
            # None of these fields is a list for one sequence, so a list means one value per item.
            value = body.get(key)
            if value is None:
                return [default] * n
            if isinstance(value, list):
                if not batch or len(value) != n:
                    _fail(f"{key} is a list of {len(value)} but the request has {n} prompt(s)")
                return [default if v is None else v for v in value]
            return [value] * n

        sps = per_item("sampling_params", {})
        rids = per_item("rid", None)
        return_lp = per_item("return_logprob", False)
        starts = per_item("logprob_start_len", -1)
        tops = per_item("top_logprobs_num", 0)
        texts_in_lp = per_item("return_text_in_logprobs", False)
        reqs, entries = [], 0
        for i, ids in enumerate(ids_list):
            params, spec = self.sampling_params(sps[i], len(ids), DEFAULT_MAX_NEW_TOKENS)
            want_lp = _bool(return_lp[i], "return_logprob")
            start = _int(starts[i], "logprob_start_len", lo=-1)
            if want_lp and start > len(ids):
                _fail(f"logprob_start_len={start} is higher than the number of input tokens ({len(ids)})")
            top_n = _int(tops[i], "top_logprobs_num", lo=0, hi=vocab)
            if want_lp:
                entries += top_n * (params.max_new_tokens + (len(ids) - start if start >= 0 else 0))
                self.check_top_logprobs(entries)
            rid = rids[i]
            if rid is not None and not isinstance(rid, str):
                _fail(f"rid must be a string, got {rid!r}")
            reqs.append(GenerateRequest(
                input_ids=ids, params=params, rid=rid or uuid.uuid4().hex, return_logprob=want_lp,
                logprob_start_len=start if want_lp else -1, top_logprobs_num=top_n if want_lp else 0,
                grammar=await self.compile(spec)))
        return reqs, batch, [bool(t) for t in texts_in_lp]

    def check_batch(self, n: int) -> None:
        if n > self.limits.max_batch_prompts:
            _fail(f"the request has {n} prompts; the server takes at most {self.limits.max_batch_prompts} "
                  f"per request (--max-batch-prompts)")

    def check_top_logprobs(self, entries: int) -> None:
        """top_logprobs_num x positions bounds the reply: 200 bytes once asked for 32.9 MB."""
        if entries > self.limits.max_top_logprobs_entries:
            _fail(f"the request asks for up to {entries} top-logprob entries (top_logprobs_num x tokens); the "
                  f"server returns at most {self.limits.max_top_logprobs_entries} (--max-top-logprobs-entries)")

    def sglang_response(self, req: GenerateRequest, res: GenerateResult, text_in_lp: bool) -> dict:
        """SGLang's /generate reply for one sequence."""
        decode = (lambda t: self.engine.tokenizer.decode([t])) if text_in_lp else (lambda t: None)
        meta = {
            "id": res.rid,
            "finish_reason": res.finish_reason,
            "prompt_tokens": len(res.prompt_ids),
            "completion_tokens": len(res.output_ids),
            "cached_tokens": res.cached_tokens,
            "weight_version": res.weight_version,
            "e2e_latency": res.e2e_latency,
            "queue_time": res.queue_time,
        }
        if req.return_logprob:
            meta["input_token_logprobs"] = [[lp, t, decode(t)] for lp, t in zip(res.input_logprobs, res.input_token_ids)]
            meta["output_token_logprobs"] = [[lp, t, decode(t)] for lp, t in zip(res.output_logprobs, res.output_ids)]
            if req.top_logprobs_num > 0:
                def tops(entries):
                    return [None if e is None else [[lp, t, decode(t)] for lp, t in e] for e in entries]
                meta["input_top_logprobs"] = tops(res.input_top_logprobs or [])
                meta["output_top_logprobs"] = tops(res.output_top_logprobs or [])
        return {"text": res.text, "output_ids": res.output_ids, "meta_info": meta}

    async def run(self, request: Request, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        """Submit ``reqs`` to the engine and await them; a client that disconnects aborts them."""
        loop = asyncio.get_running_loop()
        futures = []
        for req in reqs:
            fut = loop.create_future()

            def done(result, fut=fut):
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

            self.engine.submit(req, done)
            futures.append(fut)
        pending = set(futures)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=1.0)
            if pending and await request.is_disconnected():
                for req, fut in zip(reqs, futures):
                    if not fut.done():
                        self.engine.abort(req.rid)
                await asyncio.wait(pending)
                break
        return [f.result() for f in futures]

    # -- OpenAI --

    def openai_params(self, body: dict, prompt_len: int, default_max: Optional[int]) -> tuple[SamplingParams, Any]:
        """OpenAI request fields (plus SGLang's extras) -> sampling params and grammar spec."""
        if body.get("stream"):
            _fail("stream=true is not supported by the embedded server")
        raw: dict = {}
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None:
            raw["max_new_tokens"] = max_tokens
        # OpenAI's fields and SGLang's extras on its ChatCompletionRequest, checked by the same contract
        # as /generate (n, penalties, min_p, logit_bias: their neutral values only).
        for key in ("temperature", "top_p", "top_k", "stop", "stop_token_ids", "stop_regex", "ignore_eos", "regex",
                    "ebnf", "skip_special_tokens", "no_stop_trim", "n", "frequency_penalty", "presence_penalty",
                    "repetition_penalty", "min_p", "logit_bias", "custom_params", "watermark"):
            if body.get(key) is not None:
                raw[key] = body[key]
        for key, sglang_key in (("seed", "sampling_seed"), ("min_tokens", "min_new_tokens")):
            if body.get(key) is not None:
                raw[sglang_key] = body[key]
        fmt = body.get("response_format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
                _fail("response_format.type must be text, json_object or json_schema")
            if fmt["type"] == "json_object":
                raw["json_schema"] = json.dumps({"type": "object"})
            elif fmt["type"] == "json_schema":
                js = fmt.get("json_schema")
                schema = js.get("schema", js.get("schema_")) if isinstance(js, dict) else None
                if schema is None:
                    _fail("response_format.json_schema.schema is required")
                raw["json_schema"] = schema if isinstance(schema, str) else json.dumps(schema)
        return self.sampling_params(raw, prompt_len, default_max)

    async def chat_prompt(self, messages: Any) -> list[int]:
        """Apply the model's chat template (with the generation prompt) and tokenize."""
        if not isinstance(messages, list) or not messages:
            _fail("messages must be a non-empty list")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                _fail(f"messages[{i}] must be an object with a role")
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                content = "".join(parts)
            if content is None:
                content = ""
            if not isinstance(content, str):
                _fail(f"messages[{i}].content must be a string or a list of text parts")
            clean.append({"role": m["role"], "content": content})
        self.check_batch(len(clean))
        self.check_text_size([m["content"] for m in clean], "conversation")     # all of it shares one context
        text = await asyncio.to_thread(self.engine.tokenizer.apply_chat_template, clean, tokenize=False,
                                       add_generation_prompt=True)
        ids = (await self.encode([text], "chat prompt", add_special_tokens=False))[0]
        if not ids:
            _fail("the chat prompt encodes to no tokens")
        return ids

    def content_len(self, res: GenerateResult, params: SamplingParams) -> int:
        """Output tokens that belong to the text (a matched stop token is trimmed, as in ``text``)."""
        matched = res.finish_reason.get("matched")
        trimmed = (isinstance(matched, int) and not params.no_stop_trim and res.output_ids
                   and res.output_ids[-1] == matched)
        return len(res.output_ids) - (1 if trimmed else 0)

    def token_str(self, token: int) -> str:
        return self.engine.tokenizer.decode([token])

    def usage(self, results: list[GenerateResult]) -> dict:
        p = sum(len(r.prompt_ids) for r in results)
        c = sum(len(r.output_ids) for r in results)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _finish_type(res: GenerateResult) -> str:
    return res.finish_reason["type"]


# ---- OpenAI reply pieces -------------------------------------------------------------------------------

async def _completion_prompts(srv: _Server, prompt: Any) -> list[list[int]]:
    """OpenAI ``prompt`` (a string, strings, token ids or lists of them) -> token id lists."""
    vocab = srv.engine.vocab_size
    if isinstance(prompt, list):
        srv.check_batch(len(prompt))
    if isinstance(prompt, str):
        prompts = await srv.encode([prompt], "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = await srv.encode(prompt, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [_token_ids(p, f"prompt[{i}]", vocab) for i, p in enumerate(prompt)]
    elif isinstance(prompt, list):
        prompts = [_token_ids(prompt, "prompt", vocab)]
    else:
        _fail("prompt must be a string, a list of strings, or token ids")
    if any(not p for p in prompts):
        _fail("prompt encodes to no tokens")
    return prompts


# ---- the app: one function per route group ---------------------------------------------------------------

def _add_error_handlers(app: FastAPI) -> None:
    """Every client mistake is a 400 with SGLang's error JSON (an oversized body a 413)."""
    async def bad_request(request: Request, exc: Exception):
        return _error(400, str(exc))

    for kind in (RequestError, ContractError, BadBody, GrammarError, RequestValidationError):
        app.add_exception_handler(kind, bad_request)

    @app.exception_handler(TooLarge)
    async def _too_large(request: Request, exc: TooLarge):
        return _error(413, str(exc), "PayloadTooLarge")


def _add_info_routes(app: FastAPI, srv: _Server, model_path: str) -> None:
    """``/health``, ``/health_generate``, ``/get_model_info``, ``/get_server_info``, ``/v1/models``."""
    engine = srv.engine

    @app.get("/health")
    async def health():
        return Response(status_code=200) if engine.alive else _error(503, "engine is not running", "ServiceUnavailable")

    @app.get("/health_generate")
    async def health_generate(request: Request):
        if not engine.alive:
            return _error(503, "engine is not running", "ServiceUnavailable")
        probe = GenerateRequest(input_ids=[min(engine.eos_ids or {0})],
                                params=SamplingParams(max_new_tokens=1, temperature=0.0),
                                rid=f"health-{uuid.uuid4().hex}")
        try:
            res = (await asyncio.wait_for(srv.run(request, [probe]), timeout=30.0))[0]
        except asyncio.TimeoutError:
            engine.abort(probe.rid)
            return _error(503, "generation did not finish within 30 s", "ServiceUnavailable")
        if _finish_type(res) == "abort":
            return _error(503, res.finish_reason.get("message", "aborted"), "ServiceUnavailable")
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": engine.model_path, "tokenizer_path": model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": engine.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(engine.config, "model_type", None),
                "architectures": getattr(engine.config, "architectures", None)}

    @app.get("/get_server_info")
    async def get_server_info():
        return {"model_path": engine.model_path, "tokenizer_path": model_path,
                "served_model_name": srv.served_model_name, "host": srv.host, "port": srv.port,
                "context_length": engine.context_length, "max_running_requests": engine.max_batch_size,
                "max_prefill_tokens": engine.max_prefill_tokens, "dtype": engine.dtype_name,
                "threads": engine.threads, "random_seed": engine.random_seed, "device": str(engine.device),
                "grammar_backend": "xgrammar",
                "constrained_json_disable_any_whitespace": not engine.grammar.any_whitespace,
                "grammar_cache": engine.grammar.cache.stats(),
                "weight_version": engine.weight_version, "version": SERVER_VERSION,
                "uptime_s": time.time() - srv.started, "internal_states": [engine.load()]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": srv.served_model_name, "object": "model",
                                            "created": int(srv.started), "owned_by": "aflow_rl",
                                            "root": engine.model_path, "max_model_len": engine.context_length}]}


def _add_admin_routes(app: FastAPI, srv: _Server) -> None:
    """``/flush_cache``, ``/abort_request``, ``/update_weights_from_disk``, and the pause routes."""
    engine = srv.engine
    _add_pause_routes(app, srv)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        engine.flush_cache()   # the prefix cache; running requests keep their own KV
        return PlainTextResponse("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await _json_body(request)
        rid, abort_all = body.get("rid", ""), bool(body.get("abort_all", False))
        if not isinstance(rid, str):
            _fail("rid must be a string")
        if not rid and not abort_all:
            _fail("give a rid, or abort_all=true")
        engine.abort(rid or None, abort_all)
        return Response(status_code=200)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await _json_body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            _fail("model_path (a Hugging Face model directory) is required")
        if not os.path.isdir(path):
            # Never a hub id: a download from the server stalled generation for 23.6 s and probed DNS.
            return JSONResponse({"success": False, "num_paused_requests": 0, "weight_version": engine.weight_version,
                                 "message": "model_path must be a local model directory on the server"},
                                status_code=400)
        version = body.get("weight_version")
        if version is not None and not isinstance(version, (str, int)):
            _fail("weight_version must be a string")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        engine.update_weights_from_disk(
            path, None if version is None else str(version),
            lambda ok, msg: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result((ok, msg))),
            abort_all=bool(body.get("abort_all_requests", False)))
        ok, message = await fut
        return JSONResponse({"success": ok, "message": message, "num_paused_requests": 0,
                             "weight_version": engine.weight_version}, status_code=200 if ok else 400)


async def _optional_body(request: Request) -> dict:
    """The JSON object of a request whose fields all have defaults; an empty body is ``{}``."""
    if request.headers.get("content-length") == "0":
        return {}
    return await _json_body(request)


def _add_pause_routes(app: FastAPI, srv: _Server) -> None:
    """SGLang's ``/pause_generation`` and ``/continue_generation`` (same bodies, same replies).

    ``{"mode": "abort" | "retract" | "in_place"}`` (SGLang's default ``abort``). The reply comes
    once the engine thread has stopped between two decode steps, so an update sent after it is
    applied without waiting for the running requests. ``/continue_generation`` takes SGLang's
    ``torch_empty_cache`` (a CUDA allocator call, nothing to do on CPU).
    """
    engine = srv.engine

    async def on_engine_thread(call, *args) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        call(*args, lambda: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None)))
        await fut

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await _optional_body(request)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            _fail(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await on_engine_thread(engine.pause, mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        body = await _optional_body(request)
        _bool(body.get("torch_empty_cache", True), "torch_empty_cache")
        await on_engine_thread(engine.resume)
        return {"message": "Generation continued successfully.", "status": "ok"}


def _add_generate_route(app: FastAPI, srv: _Server) -> None:
    """SGLang's native ``/generate``."""
    @app.post("/generate")
    async def generate(request: Request):
        body = await _json_body(request)
        if streaming.fans_out(body, "generate"):   # n > 1 or stream: true
            return await streaming.generate(srv, request, body)
        reqs, batch, text_lp = await srv.parse_generate(body)
        results = await srv.run(request, reqs)
        out = [srv.sglang_response(r, res, t) for r, res, t in zip(reqs, results, text_lp)]
        return JSONResponse(out if batch else out[0])


def _add_openai_routes(app: FastAPI, srv: _Server) -> None:
    """OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions``."""
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json_body(request)
        if streaming.fans_out(body, "chat"):   # n > 1 or stream: true
            return await streaming.chat(srv, request, body, MAX_TOP_LOGPROBS)
        ids = await srv.chat_prompt(body.get("messages"))
        params, spec = srv.openai_params(body, len(ids), None)
        want_lp = _bool(body.get("logprobs", False) or False, "logprobs")
        top_n = _int(body.get("top_logprobs") or 0, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        req = GenerateRequest(input_ids=ids, params=params, rid=f"chatcmpl-{uuid.uuid4().hex}",
                              return_logprob=want_lp, top_logprobs_num=top_n if want_lp else 0,
                              grammar=await srv.compile(spec))
        res = (await srv.run(request, [req]))[0]
        return {"id": res.rid, "object": "chat.completion", "created": int(time.time()),
                "model": srv.served_model_name, "choices": [streaming.chat_choice(srv, res, params, want_lp)],
                "usage": srv.usage([res]), "metadata": {"weight_version": res.weight_version}}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_body(request)
        fans_out = streaming.fans_out(body, "completions")   # n > 1 or stream: true
        rest = {k: v for k, v in body.items() if k not in streaming.FANOUT_KEYS} if fans_out else body
        reqs, all_params, top_n = await _completion_requests(srv, rest)
        if fans_out:
            return await streaming.completions(srv, request, body, reqs, all_params, top_n)
        results = await srv.run(request, reqs)
        choices = [streaming.completion_choice(srv, res, params, top_n, i)
                   for i, (res, params) in enumerate(zip(results, all_params))]
        return {"id": results[0].rid, "object": "text_completion", "created": int(time.time()),
                "model": srv.served_model_name, "choices": choices, "usage": srv.usage(results),
                "metadata": {"weight_version": results[0].weight_version}}


async def _completion_requests(srv: _Server, body: dict) -> tuple[list[GenerateRequest], list[SamplingParams],
                                                                  Optional[int]]:
    """One engine request per prompt of a ``/v1/completions`` body, their sampling params, and
    ``logprobs`` (the number of top alternatives; None when not asked)."""
    if body.get("echo"):
        _fail("echo=true is not supported by the embedded server")
    if body.get("suffix"):
        _fail("suffix is not supported by the embedded server")
    prompts = await _completion_prompts(srv, body.get("prompt"))
    top_n = body.get("logprobs")
    top_n = None if top_n is None else _int(top_n, "logprobs", 0, MAX_TOP_LOGPROBS)
    reqs, all_params = [], []
    for ids in prompts:
        params, spec = srv.openai_params(body, len(ids), 16)   # OpenAI's default max_tokens
        all_params.append(params)
        srv.check_top_logprobs(sum((top_n or 0) * p.max_new_tokens for p in all_params))
        reqs.append(GenerateRequest(input_ids=ids, params=params, rid=f"cmpl-{uuid.uuid4().hex}",
                                    return_logprob=top_n is not None, top_logprobs_num=top_n or 0,
                                    grammar=await srv.compile(spec)))
    return reqs, all_params, top_n


def create_app(model_path: str, *, served_model_name: Optional[str] = None, host: str = "127.0.0.1",
               port: int = 0, engine: Optional[Engine] = None, limits: Limits = Limits(),
               api_key: Optional[str] = None, admin_api_key: Optional[str] = None,
               weights_update_timeout_s: float = 300.0, **engine_kwargs) -> FastAPI:
    """Build the FastAPI app; loads the model now (or uses ``engine``) and runs it while the app lives.

    ``engine_kwargs`` go to :class:`~aflow_rl.serving.generation.Engine` (``dtype``,
    ``max_batch_size``, ``context_length``, ``threads``, ``device``, ``json_any_whitespace``, ``random_seed``);
    ``limits`` bound each request; ``api_key``/``admin_api_key`` work as SGLang's flags.
    """
    engine = engine or Engine(model_path, **engine_kwargs)
    srv = _Server(engine, served_model_name or model_path, host, port, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info("embedded server ready: model=%s context=%d max_batch=%d threads=%d",
                 model_path, engine.context_length, engine.max_batch_size, engine.threads)
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="aflow_rl embedded server", lifespan=lifespan)
    app.state.server = srv
    app.add_middleware(ApiKeyMiddleware, api_key=api_key, admin_api_key=admin_api_key)
    _add_error_handlers(app)
    _add_info_routes(app, srv, model_path)
    _add_admin_routes(app, srv)
    add_distributed_routes(app, srv, weights_update_timeout_s)   # SGLang's distributed weight sync
    _add_generate_route(app, srv)
    _add_openai_routes(app, srv)
    return app


# ---- command line ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The CLI contract the server manager relies on."""
    ap = argparse.ArgumentParser(prog="python -m aflow_rl.serving.embedded",
                                 description="Embedded server (CPU, or one GPU with --device) speaking SGLang's HTTP API.")
    ap.add_argument("--model-path", required=True, help="Hugging Face model directory")
    ap.add_argument("--port", type=int, default=30000, help="port to listen on (SGLang's default 30000)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind")
    ap.add_argument("--max-batch-size", "--max-running-requests", dest="max_batch_size", type=int, default=64,
                    help="most sequences decoded together; more requests wait")
    ap.add_argument("--context-length", type=int, default=None,
                    help="prompt + output token limit (default: the model's max_position_embeddings)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="weights dtype; auto keeps bfloat16 checkpoints, else float32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: min(2, cpu count))")
    ap.add_argument("--device", default="cpu",
                    help="cpu | cuda | cuda:N: where the weights, forwards and KV live (SGLang's --device); "
                         "sampling and grammars stay on the CPU")
    ap.add_argument("--served-model-name", default=None, help="model id in /v1 replies (default: the path)")
    ap.add_argument("--random-seed", type=int, default=None, help="seed of the shared sampling generator")
    ap.add_argument("--json-any-whitespace", action="store_true",
                    help="JSON grammars allow free whitespace (SGLang's default); off = compact JSON, like "
                         "SGLang's --constrained-json-disable-any-whitespace")
    ap.add_argument("--disable-radix-cache", action="store_true",
                    help="no prefix cache (SGLang's flag); outputs are identical either way, only slower")
    ap.add_argument("--prefill-chunk", type=int, default=32,
                    help="tokens per prefill forward and the prefix cache's granularity")
    ap.add_argument("--prefix-cache-tokens", type=int, default=65536,
                    help="the prefix cache's budget in tokens (least recently used chunks go first)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                    help=f"require 'Authorization: Bearer KEY' on every route but /health* (as SGLang); "
                         f"default ${API_KEY_ENV}, which keeps the key out of the process list")
    ap.add_argument("--admin-api-key", default=os.environ.get(ADMIN_API_KEY_ENV),
                    help=f"key for /update_weights_from_disk, /flush_cache, /abort_request, /pause_generation, "
                         f"/continue_generation (default "
                         f"${ADMIN_API_KEY_ENV}; unset: --api-key guards them)")
    ap.add_argument("--weights-update-timeout", type=float, default=300.0,
                    help="seconds a rendezvous or broadcast of /init_weights_update_group's group may wait "
                         "for the trainer before it fails")
    d = Limits()
    ap.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes, help="largest request body (413 over)")
    ap.add_argument("--max-batch-prompts", type=int, default=d.max_batch_prompts, help="most prompts per request")
    ap.add_argument("--max-top-logprobs-entries", type=int, default=d.max_top_logprobs_entries,
                    help="most top_logprobs_num x tokens one request may ask for")
    ap.add_argument("--grammar-compile-timeout", type=float, default=d.grammar_compile_timeout_s,
                    help="seconds a request waits for its grammar to compile (400 after)")
    ap.add_argument("--max-concurrent-compiles", type=int, default=d.max_concurrent_compiles,
                    help="grammar compilations running at once")
    # auto = uvicorn's standard extras (httptools, uvloop) when installed; h11/asyncio to compare.
    ap.add_argument("--http", dest="http_impl", default="auto", choices=["auto", "h11", "httptools"],
                    help="uvicorn HTTP parser (auto: httptools when installed)")
    ap.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                    help="event loop (auto: uvloop when installed)")
    return ap


def main(argv: Optional[list[str]] = None) -> None:
    """Load the model, then serve until SIGINT/SIGTERM."""
    import uvicorn

    args = build_parser().parse_args(argv)
    # Started by ServerManager: exit with it, however it ends (kill -9 included). A watchdog thread,
    # because loading the model takes seconds and a dead launcher must not leave a listening orphan.
    from aflow_rl.procs import die_with_parent_from_env

    die_with_parent_from_env()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not os.path.isdir(args.model_path):
        raise SystemExit(f"--model-path {args.model_path!r} is not a directory")
    if args.prefill_chunk < 1 or args.prefix_cache_tokens < 0:
        raise SystemExit("--prefill-chunk must be >= 1 and --prefix-cache-tokens >= 0")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per weight update would clutter the log
    limits = Limits(args.max_request_bytes, args.max_batch_prompts, args.max_top_logprobs_entries,
                    args.grammar_compile_timeout, args.max_concurrent_compiles)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who reaches the port can generate (and, without "
                    "--admin-api-key, update the weights); see docs/security.md", args.host)
    app = create_app(args.model_path, served_model_name=args.served_model_name, host=args.host, port=args.port,
                     limits=limits, api_key=args.api_key, admin_api_key=args.admin_api_key, dtype=args.dtype, max_batch_size=args.max_batch_size, context_length=args.context_length,
                     threads=args.threads, device=args.device, json_any_whitespace=args.json_any_whitespace,
                     random_seed=args.random_seed, prefix_cache=not args.disable_radix_cache,
                     prefill_chunk=args.prefill_chunk, prefix_cache_tokens=args.prefix_cache_tokens,
                     weights_update_timeout_s=args.weights_update_timeout)
    # uvicorn's own logs stay at warning: an access line per request would cost throughput.
    uvicorn.run(app, host=args.host, port=args.port, log_level="debug" if args.log_level == "debug" else "warning",
                access_log=False, timeout_graceful_shutdown=5, http=args.http_impl, loop=args.loop)


if __name__ == "__main__":
    main()
