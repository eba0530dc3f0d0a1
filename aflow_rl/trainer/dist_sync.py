"""``trainer.sync=distributed``: push the policy's weights to the servers over a torch.distributed group.

SGLang's protocol (0.5.x), which the embedded server speaks too (serving/dist_routes.py):

1. once: ``/init_weights_update_group`` on every server (its ``rank_offset``: 1 + the tensor-
   parallel ranks of the servers before it), while trainer rank 0 joins as group rank 0 and
   hosts the rendezvous store (:mod:`aflow_rl.update_group`);
2. per sync: ``/begin_weight_update``; per bucket of parameters (``trainer.sync_bucket_mb``),
   ``/update_weights_from_distributed`` with the bucket's names, dtypes and shapes while rank 0
   broadcasts the tensors in that order; ``/end_weight_update``. The last bucket carries
   ``weight_version`` and ``flush_cache``.

Under ZeRO-3 every rank holds a slice of each weight: the bucket's parameters are gathered with
``deepspeed.zero.GatheredParameters`` (every rank takes part, rank 0 broadcasts), one bucket at a
time, so no rank ever holds more than one bucket of full weights beyond its own shard.

Nothing may hang: the whole push has ``trainer.sync_timeout_s``; broadcasts are posted
asynchronously and polled against that deadline next to the servers' HTTP replies, so a server
that refuses a bucket fails the sync at once and one that never answers fails it at the deadline.
After a failure rank 0 still walks the remaining buckets (the other ranks are gathering them),
then every rank raises the same ``WeightSyncError``.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any

import torch

from aflow_rl.dist import rank_world
from aflow_rl.llm.base import LLMError
from aflow_rl.serving.weight_sync import WeightSyncError
from aflow_rl.update_group import (broadcast_async, destroy_update_group, dtype_name, in_daemon_thread,
                                   init_update_group)

GROUP = "aflow_rl_weights"
_POLL_S = 0.002


def _module_and_zero3(engine_or_model: Any) -> tuple[torch.nn.Module, bool]:
    if hasattr(engine_or_model, "zero_optimization_partition_weights"):
        return engine_or_model.module, bool(engine_or_model.zero_optimization_partition_weights())
    return engine_or_model, False


def _shape(p: torch.Tensor) -> list[int]:
    return list(getattr(p, "ds_shape", None) or p.shape)   # ZeRO-3: the full shape, not the empty slice


def plan_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive parameters, each bucket at most ``bucket_bytes`` (a larger tensor goes alone).
    Every rank computes the same plan from the full shapes."""
    buckets, cur, size = [], [], 0
    for name, p in named:
        nbytes = int(torch.Size(_shape(p)).numel()) * p.element_size()
        if cur and size + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, p))
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


def _gathered(params: list[torch.Tensor], zero3: bool):
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def free_port(address: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class DistributedSync:
    """Rank 0's weight-update group with the policy servers, and the per-sync push (collective)."""

    def __init__(self, *, bucket_mb: float = 512.0, master_address: str = "127.0.0.1", master_port: int = 0,
                 backend: str = "gloo", timeout_s: float = 120.0, group_name: str = GROUP):
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.master_address, self.master_port = master_address, int(master_port)
        self.backend, self.timeout_s, self.group_name = backend, float(timeout_s), group_name
        self.pg = None
        self.urls: list[str] = []

    @classmethod
    def from_config(cls, tcfg: Any, policy_backend: str = "sglang") -> "DistributedSync":
        backend = tcfg.sync_backend
        if backend == "auto":   # the embedded server runs on CPU: gloo; SGLang on GPUs: NCCL
            backend = "nccl" if torch.cuda.is_available() and policy_backend != "embedded" else "gloo"
        return cls(bucket_mb=tcfg.sync_bucket_mb, master_address=tcfg.sync_master_address,
                   master_port=tcfg.sync_master_port, backend=backend, timeout_s=tcfg.sync_timeout_s)

    def close(self) -> None:
        """Leave the group on this side (the servers drop theirs at the next trainer's connect)."""
        if self.pg is not None:
            destroy_update_group(self.pg)
            self.pg, self.urls = None, []

    # ---- collective entry point --------------------------------------------------------------

    def push(self, engine_or_model: Any, client: Any, version: int) -> dict:
        """Every rank calls this; rank 0 passes the policy client (others None). Returns timings."""
        module, zero3 = _module_and_zero3(engine_or_model)
        buckets = plan_buckets(list(module.named_parameters()), self.bucket_bytes)
        main = client is not None and bool(client.urls)
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        error: str | None = None
        with asyncio.Runner() as runner:
            if main:
                error = self._run(runner, self._start(client, deadline))
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                with _gathered([p for _, p in bucket], zero3):
                    if main and error is None:
                        error = self._run(runner, self._send(client, bucket, str(version) if last else None,
                                                             last, deadline))
            if main and error is None:
                error = self._run(runner, self._call_all(client, "/end_weight_update", {}, deadline))
        error = _share_from_rank0(error)
        if error is not None:
            raise WeightSyncError(error)
        return {"update_s": time.monotonic() - t0, "buckets": len(buckets)}

    @staticmethod
    def _run(runner: asyncio.Runner, coro) -> str | None:
        try:
            runner.run(coro)
            return None
        except WeightSyncError as exc:
            return str(exc)

    # ---- rank 0 ------------------------------------------------------------------------------

    async def _start(self, client: Any, deadline: float) -> None:
        if self.pg is None or self.urls != list(client.urls):
            if self.pg is not None:   # a server left or came back: a new group for the new set
                destroy_update_group(self.pg)
                self.pg = None
            await self._connect(client, deadline)
        await self._call_all(client, "/begin_weight_update", {}, deadline)

    async def _connect(self, client: Any, deadline: float) -> None:
        """Join the servers into a new group. What an earlier trainer process may have left is
        cleared first: a weight-update session it never ended (SGLang refuses a second
        ``/begin_weight_update``) and a group of the same name."""
        urls = list(client.urls)
        for path, payload in (("/end_weight_update", {}), ("/destroy_weights_update_group",
                                                           {"group_name": self.group_name})):
            await asyncio.gather(*(self._post(client, u, path, payload, deadline, check=False) for u in urls))
        tp = [await self._tp_size(client, u, deadline) for u in urls]
        world = 1 + sum(tp)
        port = self.master_port or free_port(self.master_address)
        offsets = [1 + sum(tp[:i]) for i in range(len(urls))]
        posts = [asyncio.ensure_future(self._post(client, u, "/init_weights_update_group", {
            "master_address": self.master_address, "master_port": port, "rank_offset": off, "world_size": world,
            "group_name": self.group_name, "backend": self.backend}, deadline)) for u, off in zip(urls, offsets)]
        joined = in_daemon_thread(init_update_group, self.master_address, port, 0, world, self.group_name,
                            self.backend, max(1.0, deadline - time.monotonic()))
        await self._wait(posts, urls, lambda: joined.done(), deadline, "join the weight-update group")
        if joined.exception() is not None:
            raise WeightSyncError(f"trainer rank 0 could not create the weight-update group on "
                                  f"{self.master_address}:{port}: {joined.exception()} (set "
                                  "trainer.sync_master_address to an address of this host the servers reach)")
        self.pg, self.urls = joined.result(), urls

    async def _tp_size(self, client: Any, url: str, deadline: float) -> int:
        info = await self._post(client, url, "/get_server_info", None, deadline, method="GET", check=False)
        return int(info.get("tp_size") or 1) if isinstance(info, dict) else 1

    async def _send(self, client: Any, bucket: list, version: str | None, last: bool, deadline: float) -> None:
        tensors = [(name, p.data.contiguous()) for name, p in bucket]
        meta: dict[str, Any] = {"names": [n for n, _ in tensors], "dtypes": [dtype_name(t.dtype) for _, t in tensors],
                                "shapes": [list(t.shape) for _, t in tensors], "group_name": self.group_name,
                                "flush_cache": last}
        if version is not None:
            meta["weight_version"] = version
        posts = [asyncio.ensure_future(self._post(client, u, "/update_weights_from_distributed", meta, deadline))
                 for u in self.urls]
        works = [broadcast_async(t, self.pg) for _, t in tensors]
        await self._wait(posts, self.urls, lambda: all(w.is_completed() for w in works), deadline,
                         "receive a bucket")
        try:
            for w in works:
                w.wait()
        except Exception as exc:   # gloo/NCCL: a peer left mid-broadcast
            raise WeightSyncError(f"broadcast of the weights failed: {exc} (a server left the group: "
                                  "check its log; a restarted trainer re-creates the group)") from None

    async def _call_all(self, client: Any, path: str, payload: dict, deadline: float) -> None:
        posts = [asyncio.ensure_future(self._post(client, u, path, payload, deadline)) for u in self.urls]
        await self._wait(posts, self.urls, lambda: True, deadline, path.strip("/"))

    async def _wait(self, posts: list, urls: list[str], local_done, deadline: float, what: str) -> None:
        """Until every server answered and ``local_done()``; the first refusal, or the deadline, raises."""
        try:
            while True:
                for task in posts:
                    if task.done() and task.exception() is not None:
                        raise task.exception()
                if local_done() and all(t.done() for t in posts):
                    return
                if time.monotonic() > deadline:
                    silent = [u for u, t in zip(urls, posts) if not t.done()]
                    raise WeightSyncError(
                        f"weight sync: could not {what} within trainer.sync_timeout_s={self.timeout_s:g} s "
                        f"(no answer from {silent or 'none'}{'' if local_done() else '; the trainer side is unfinished too'});"
                        " check those servers' logs, or raise trainer.sync_timeout_s for large models")
                await asyncio.sleep(_POLL_S)
        finally:
            for task in posts:
                task.cancel()

    async def _post(self, client: Any, url: str, path: str, payload: Any, deadline: float, *, method: str = "POST",
                    check: bool = True) -> Any:
        remaining = deadline - time.monotonic()
        try:
            resp = await client.http.request(method, path, json=payload, url=url, timeout_s=max(0.1, remaining),
                                             retry=False)
            reply = resp.json()
        except (LLMError, ValueError) as exc:
            if not check:
                return None
            status = getattr(exc, "status", None)
            if isinstance(exc, LLMError) and status is None:
                raise WeightSyncError(f"{url}{path} did not answer the weight sync ({exc}); check that server's "
                                      "log, or raise trainer.sync_timeout_s for large models") from None
            hint = (" (trainer.sync=distributed needs SGLang >= 0.5.23 or the embedded server; trainer.sync=disk "
                    "works with every server)" if status == 404 else "")
            raise WeightSyncError(f"{url}{path} refused the weight sync: {exc}{hint}") from None
        if check and not (isinstance(reply, dict) and reply.get("success")):
            raise WeightSyncError(f"{url}{path} refused the weight sync: {reply!r}")
        return reply


def _share_from_rank0(obj: Any) -> Any:
    _, world = rank_world()
    if world == 1:
        return obj
    from aflow_rl.trainer.learner import share_from_rank0

    return share_from_rank0(obj)
