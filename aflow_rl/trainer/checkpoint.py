"""Checkpoints under ``run_dir/checkpoints/step_<N>``: resumable and servable.

A checkpoint directory holds

    deepspeed/            engine.save_checkpoint: weights, optimizer, LR schedule, step counters
    hf/                   Hugging Face export (AutoModelForCausalLM, SGLang)
    trainer_state.json    step, task sampler position, annealing position, extra state
    rng/rank_<r>.json     python / numpy / torch (/ cuda) RNG states of each rank
    COMPLETE              written last

It is written as ``.step_<N>.tmp`` and renamed when complete, so a ``step_<N>``
directory is never partial; :func:`latest_checkpoint` also requires the marker.
Saving and loading are collective: every rank calls them (on a shared filesystem).
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from aflow_rl.trainer.weights import export_hf

CHECKPOINTS = "checkpoints"
DS_TAG = "deepspeed"
MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^step_(\d+)$")


@dataclass
class TrainerState:
    """What the training loop needs besides weights and optimizer to continue exactly.

    step: optimizer steps done. sampler: the task sampler's position or state
    (JSON). anneal_step: position of the PARL lambda annealing. extra: anything
    else JSON-safe (reward baselines, experience pool, policy version, ...).
    """

    step: int = 0
    sampler: Any = None
    anneal_step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# RNG states
# ---------------------------------------------------------------------------


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng() -> dict:
    """This process's python, numpy, torch (and CUDA) RNG states, JSON-safe."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict) -> None:
    """Inverse of :func:`capture_rng`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


# ---------------------------------------------------------------------------
# Finding checkpoints
# ---------------------------------------------------------------------------


def _step_of(path: str) -> int | None:
    m = _NAME.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def is_complete(path: str) -> bool:
    """A finished checkpoint: named ``step_<N>`` and holding the ``COMPLETE`` marker."""
    return _step_of(path) is not None and os.path.isfile(os.path.join(path, MARKER))


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoints of a run, oldest first."""
    root = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return []
    paths = [os.path.join(root, n) for n in os.listdir(root)]
    return sorted((p for p in paths if is_complete(p)), key=_step_of)


def latest_checkpoint(run_dir: str) -> str | None:
    """The newest complete checkpoint of a run (temporary and unmarked directories are ignored)."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_resume(resume: str, run_dir: str) -> str | None:
    """The checkpoint a run starts from: ``never`` -> None; ``auto`` -> the newest
    complete one in ``run_dir`` (None for a fresh run); otherwise a checkpoint path
    (or a run directory, meaning its newest), which must exist and be complete."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    if is_complete(resume):
        return resume
    if os.path.isdir(os.path.join(resume, CHECKPOINTS)):
        found = latest_checkpoint(resume)
        if found:
            return found
        raise FileNotFoundError(f"resume: {resume!r} has no complete checkpoint under {CHECKPOINTS}/")
    if os.path.isdir(resume):
        raise FileNotFoundError(f"resume: {resume!r} is not a complete checkpoint (no {MARKER} marker or "
                                "not named step_<N>); use auto, never, or a run_dir/checkpoints/step_<N> path")
    raise FileNotFoundError(f"resume: no checkpoint at {resume!r}; use auto, never, or an existing checkpoint path")


def prune_checkpoints(run_dir: str, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints (``keep_last <= 0``
    keeps all) and leftover temporary directories; returns what was removed."""
    root = os.path.join(run_dir, CHECKPOINTS)
    removed = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith(".step_") and name.endswith(".tmp"):
                removed.append(os.path.join(root, name))
    done = list_checkpoints(run_dir)
    if keep_last > 0:
        removed += done[:-keep_last]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


# ---------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------


def _barrier() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(engine: Any, run_dir: str, state: TrainerState, *, tokenizer: Any = None,
                    keep_last: int = 0) -> str:
    """Write ``run_dir/checkpoints/step_<state.step>`` (collective) and prune to ``keep_last``.

    ``tokenizer``: object or model directory for the HF export (None: weights only).
    Returns the checkpoint path. A checkpoint of the same step is replaced.
    """
    root = os.path.join(run_dir, CHECKPOINTS)
    final = os.path.join(root, f"step_{state.step}")
    tmp = os.path.join(root, f".step_{state.step}.tmp")
    rank = _rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)   # a leftover from a crashed save
        os.makedirs(os.path.join(tmp, "rng"))
    _barrier()
    engine.save_checkpoint(tmp, tag=DS_TAG, client_state={"trainer_step": state.step})
    export_hf(engine, tokenizer, os.path.join(tmp, "hf"))
    _write_json(os.path.join(tmp, "rng", f"rank_{rank}.json"), capture_rng())
    _barrier()
    if rank == 0:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        _write_json(os.path.join(tmp, STATE_FILE), {**dataclasses.asdict(state), "world_size": world})
        _write_json(os.path.join(tmp, MARKER), {"step": state.step})
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        prune_checkpoints(run_dir, keep_last)
    _barrier()
    return final


def read_trainer_state(path: str) -> TrainerState:
    """The :class:`TrainerState` stored in checkpoint ``path`` (no weights loaded)."""
    with open(os.path.join(path, STATE_FILE)) as f:
        raw = json.load(f)
    names = {f.name for f in dataclasses.fields(TrainerState)}
    return TrainerState(**{k: v for k, v in raw.items() if k in names})


def load_checkpoint(engine: Any, path: str, *, load_optimizer: bool = True) -> TrainerState:
    """Restore weights, optimizer and LR schedule into ``engine``, this rank's RNG
    states, and return the :class:`TrainerState` (collective)."""
    if not is_complete(path):
        raise FileNotFoundError(f"not a complete checkpoint: {path!r}")
    loaded, _ = engine.load_checkpoint(path, tag=DS_TAG, load_optimizer_states=load_optimizer,
                                       load_lr_scheduler_states=load_optimizer)
    if loaded is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {path!r}")
    rng_file = os.path.join(path, "rng", f"rank_{_rank()}.json")
    if os.path.isfile(rng_file):   # absent when resuming with more ranks than were saved
        with open(rng_file) as f:
            restore_rng(json.load(f))
    return read_trainer_state(path)
