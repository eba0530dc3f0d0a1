"""The weight-update process group of SGLang's distributed weight sync, joined from either side.

SGLang's ``/init_weights_update_group`` makes every policy server join a torch.distributed
group with the trainer: trainer rank 0 is group rank 0 (and hosts the TCP store at
``master_address:master_port``), server ``i`` takes ranks ``rank_offset ..`` (one per
tensor-parallel rank). The group is *not* the default process group: the trainer may already
be in one (torchrun, DeepSpeed) and the server has its own. To interoperate with SGLang the
rendezvous must be laid out the same way: a ``tcp://`` rendezvous store, a ``PrefixStore``
named after the group, then a process group built on it whose rank map is the identity.

Every collective on the group is bounded by ``timeout_s`` (gloo and NCCL both honour it), so
a peer that died or never joined turns into an error instead of a hang.
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

# Names SGLang's /update_weights_from_distributed accepts as dtypes (torch attribute names).
DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the form SGLang's request carries)."""
    return str(dtype).removeprefix("torch.")


def init_update_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      backend: str = "gloo", timeout_s: float = 300.0) -> Any:
    """Join (rank 0: create) the group; blocks until all ``world_size`` ranks joined or
    ``timeout_s`` passed. Returns the process group for :func:`broadcast_async`."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    if not group_name:
        raise ValueError("group_name must not be empty")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of {world_size}")
    timeout = datetime.timedelta(seconds=float(timeout_s))
    # The store a tcp:// rendezvous makes (rank 0 hosts it), built directly: under torchrun the
    # rendezvous would instead expect torchrun's agent to host it (TORCHELASTIC_USE_AGENT_STORE),
    # and trainer rank 0 would wait as a client for a store nobody serves.
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout,
                          multi_tenant=True)
    store = PrefixStore(group_name, store)
    # torch has no public call for a group outside the default one; this private helper is
    # what SGLang, verl and slime all use for it (so both ends agree on the store layout).
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_update_group(pg: Any) -> None:
    """Leave the group (each rank on its own; no collective)."""
    dist.destroy_process_group(pg)


def broadcast_async(tensor: torch.Tensor, pg: Any) -> Any:
    """Broadcast ``tensor`` from group rank 0 (send on rank 0, receive elsewhere); a Work handle."""
    return dist.broadcast(tensor, src=0, group=pg, async_op=True)


def in_daemon_thread(fn, *args) -> asyncio.Future:
    """``fn(*args)`` on a daemon thread, as a future of the running loop (a rendezvous that never
    completes must not keep the process alive at exit, as an executor thread would)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def run():
        try:
            result, error = fn(*args), None
        except BaseException as exc:   # noqa: BLE001 - delivered to the awaiting coroutine
            result, error = None, exc
        with contextlib.suppress(RuntimeError):   # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="weights-update-group", daemon=True).start()
    return fut
