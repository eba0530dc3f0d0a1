"""SGLang's distributed weight-update routes on the embedded server, over gloo.

``/init_weights_update_group`` joins the trainer's group (:mod:`aflow_rl.update_group`),
``/update_weights_from_distributed`` receives one bucket of tensors broadcast from group rank 0
(in the order of ``names``) and hands them to the engine, which copies them in between decode
steps (:meth:`Engine.update_weights_from_tensors`, the same queue as the disk path) and flushes
the prefix cache; ``weight_version`` (when given) becomes the served version.
``/begin_weight_update`` and ``/end_weight_update`` bracket a sync as SGLang 0.5.23 requires;
here they only track the session (buckets load as they arrive, as in SGLang), and an update
outside a session is accepted too, for clients written against older SGLang.
``/destroy_weights_update_group`` leaves the group. Replies are SGLang's ``{success, message}``
(HTTP 200, or 400 on failure).

The receive runs on a daemon thread, not the engine thread: generation goes on while the
tensors arrive, and a trainer that vanished mid-broadcast costs at most the group's timeout
(``--weights-update-timeout``) on that thread, never the server. A bucket whose names or shapes
do not fit the model is refused *before* receiving, so the trainer sees the 400 at once.
"""
from __future__ import annotations

import asyncio
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from aflow_rl.serving.contract import as_bool, as_int, fail
from aflow_rl.serving.guard import read_json_body
from aflow_rl.update_group import DTYPES, broadcast_async, destroy_update_group, in_daemon_thread, init_update_group

DEFAULT_GROUP = "weight_update_group"   # SGLang's default group_name


def _reply(ok: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)


def _group_name(body: dict) -> str:
    name = body.get("group_name", DEFAULT_GROUP)
    if not isinstance(name, str) or not name:
        fail("group_name must be a non-empty string")
    return name


def _bucket(body: dict, state: dict) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) per tensor, checked against the served model's state dict."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        fail("names, dtypes and shapes must be lists (one entry per tensor)")
    if not len(names) == len(dtypes) == len(shapes):
        fail(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if dtype not in DTYPES:
            fail(f"dtype {dtype!r} of {name!r} is not one of {sorted(DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            fail(f"shape of {name!r} must be a list of non-negative integers")
        if name not in state:
            fail(f"unknown parameter {name!r} for the served model")
        if list(state[name].shape) != shape:
            fail(f"parameter {name!r} has shape {shape}, the served model {list(state[name].shape)}")
        out.append((name, DTYPES[dtype], tuple(shape)))
    return out


def _receive(pg: Any, bucket: list) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the bucket from group rank 0, in order (all posted, then awaited)."""
    tensors = [(name, torch.empty(shape, dtype=dtype)) for name, dtype, shape in bucket]
    works = [broadcast_async(t, pg) for _, t in tensors]
    for work in works:
        work.wait()
    return tensors


def add_distributed_routes(app: FastAPI, srv: Any, timeout_s: float) -> None:
    """The five routes above; ``timeout_s`` bounds every rendezvous and broadcast of a group."""
    engine = srv.engine
    groups: dict[str, Any] = {}
    joining: set[str] = set()   # groups whose rendezvous is under way
    session = {"open": False}
    lock = asyncio.Lock()    # one group operation at a time: broadcasts must not interleave

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await read_json_body(request, srv.limits.max_request_bytes)
        group = _group_name(body)
        address = body.get("master_address")
        if not isinstance(address, str) or not address:
            fail("master_address (the trainer's host) is required")
        port = as_int(body.get("master_port"), "master_port", 1, 65535)
        world = as_int(body.get("world_size"), "world_size", 2)
        rank = as_int(body.get("rank_offset"), "rank_offset", 1, world - 1)
        backend = body.get("backend", "nccl")
        if backend != "gloo":
            return _reply(False, f"backend {backend!r} is not available on the embedded (CPU) server: "
                                 "use backend gloo (trainer.sync_backend=gloo)")
        if group in groups or group in joining:
            return _reply(False, f"group {group!r} already exists; destroy it first")
        # Not under the broadcast lock: a rendezvous whose trainer died must not hold up the next one.
        joining.add(group)
        try:
            groups[group] = await in_daemon_thread(init_update_group, address, port, rank, world, group,
                                                   "gloo", timeout_s)
        except Exception as exc:
            return _reply(False, f"Failed to initialize custom process group: {exc}.")
        finally:
            joining.discard(group)
        return _reply(True, "Succeeded to initialize custom process group.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await read_json_body(request, srv.limits.max_request_bytes)
        group = _group_name(body)
        if group not in groups:
            return _reply(False, f"Group {group} not in {sorted(groups)}. "
                                 "Please call `init_weights_update_group` first.")
        if body.get("load_format") is not None:
            return _reply(False, f"load_format {body['load_format']!r} is not supported by the embedded server")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, (str, int)):
            fail("weight_version must be a string")
        abort_all = as_bool(body.get("abort_all_requests", False), "abort_all_requests")
        bucket = _bucket(body, engine.model.state_dict())
        async with lock:
            try:
                tensors = await in_daemon_thread(_receive, groups[group], bucket)
            except Exception as exc:
                return _reply(False, f"Failed to receive weights: {exc}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        engine.update_weights_from_tensors(
            tensors, None if version is None else str(version),
            lambda ok, msg: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result((ok, msg))),
            abort_all=abort_all)
        return _reply(*await fut)

    @app.post("/begin_weight_update")
    async def begin_weight_update():
        if session["open"]:
            return _reply(False, "a weight-update session is already open; call end_weight_update() first")
        session["open"] = True
        return _reply(True, "Success")

    @app.post("/end_weight_update")
    async def end_weight_update():
        if not session["open"]:
            return _reply(False, "no weight-update session is open; call begin_weight_update() first")
        session["open"] = False
        return _reply(True, "Success")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        group = _group_name(await read_json_body(request, srv.limits.max_request_bytes))
        if group not in groups:
            return _reply(False, "The group to be destroyed does not exist.")
        async with lock:
            destroy_update_group(groups.pop(group))
        return _reply(True, "Succeeded to destroy custom process group.")
