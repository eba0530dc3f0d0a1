"""This process's place in the torch.distributed group, or (0, 1) when no group is set up (a single
process, a test, the time before ``setup_distributed``). The one helper every module asks."""
from __future__ import annotations

import torch


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the initialised default process group, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank() -> int:
    return rank_world()[0]
