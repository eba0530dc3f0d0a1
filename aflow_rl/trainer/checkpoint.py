"""Checkpoints under ``run_dir/checkpoints/step_<N>``: resumable, servable, verifiable.

A checkpoint directory holds

    deepspeed/            engine.save_checkpoint: weights, optimizer, LR schedule, step counters
    hf/                   Hugging Face export (AutoModelForCausalLM, SGLang)
    trainer_state.json    step, task sampler position, annealing position, extra state
    rng/rank_<r>.json     python / numpy / torch (/ cuda) RNG states of each rank
    COMPLETE              written last: the manifest (every other file's size and sha256)

It is written as ``.step_<N>.tmp`` and renamed when complete, so a ``step_<N>``
directory is never partial; :func:`latest_checkpoint` also requires the marker.
A complete checkpoint can still be damaged afterwards (a full disk, a copy cut
short, a bad block): :func:`verify_checkpoint` compares it with its manifest,
and :func:`resolve_resume` passes over a damaged one for the newest intact one.
Saving and loading are collective: every rank calls them (on a shared filesystem).
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from aflow_rl.dist import rank
from aflow_rl.trainer.weights import export_hf

CHECKPOINTS = "checkpoints"
DS_TAG = "deepspeed"
MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^step_(\d+)$")
CHECKS = ("sha256", "size")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, phrased as one line naming it and the problem."""


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


def step_of(path: str) -> int | None:
    """N of a ``step_<N>`` directory, else None."""
    m = _NAME.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def is_complete(path: str) -> bool:
    """A finished checkpoint: named ``step_<N>`` and holding the ``COMPLETE`` marker."""
    return step_of(path) is not None and os.path.isfile(os.path.join(path, MARKER))


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoints of a run, oldest first."""
    root = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return []
    paths = [os.path.join(root, n) for n in os.listdir(root)]
    return sorted((p for p in paths if is_complete(p)), key=step_of)


def latest_checkpoint(run_dir: str) -> str | None:
    """The newest complete checkpoint of a run (temporary and unmarked directories are ignored)."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_resume(resume: str, run_dir: str, *, check: str = "size",
                   skipped: list[tuple[str, str]] | None = None) -> str | None:
    """The checkpoint a run starts from: ``never`` -> None; ``auto`` -> the newest
    intact one in ``run_dir`` (None for a fresh run); otherwise a checkpoint path
    (or a run directory, meaning its newest intact one), which must exist and be intact.

    ``check``: how each candidate is verified (:func:`verify_checkpoint`). A damaged
    candidate found on the way is passed over and appended to ``skipped`` as
    ``(path, problem)``; an explicit checkpoint path that is damaged is a CheckpointError.
    """
    if resume == "never":
        return None
    if resume == "auto":
        return _newest_intact(run_dir, check, skipped)
    if is_complete(resume):
        problem = verify_checkpoint(resume, check=check)
        if problem:
            raise CheckpointError(f"resume: {resume} is damaged ({problem}); pass another checkpoint or "
                                  "a run directory (its newest intact checkpoint is used)")
        return resume
    if os.path.isdir(os.path.join(resume, CHECKPOINTS)):
        found = _newest_intact(resume, check, skipped)
        if found:
            return found
        raise CheckpointError(f"resume: {resume!r} has no intact complete checkpoint under {CHECKPOINTS}/")
    if os.path.isdir(resume):
        raise CheckpointError(f"resume: {resume!r} is not a complete checkpoint (no {MARKER} marker or "
                              "not named step_<N>); use auto, never, or a run_dir/checkpoints/step_<N> path")
    raise CheckpointError(f"resume: no checkpoint at {resume!r}; use auto, never, or an existing checkpoint path")


def _newest_intact(run_dir: str, check: str, skipped: list | None) -> str | None:
    for path in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(path, check=check)
        if problem is None:
            return path
        if skipped is not None:
            skipped.append((path, problem))
    return None


def set_aside(path: str, why: str = "invalid") -> str:
    """Rename a checkpoint to ``step_<N>.<why>[-k]`` (a damaged one: ``invalid``): kept for a
    post-mortem, but no longer listed, resumed from or counted by ``keep_last``. Returns the new path."""
    target, k = f"{path}.{why}", 1
    while os.path.exists(target):
        k += 1
        target = f"{path}.{why}-{k}"
    os.rename(path, target)
    return target


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
# Manifest and verification
# ---------------------------------------------------------------------------


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: str) -> list[str]:
    """Every file below ``root`` except the marker, as sorted relative paths."""
    out = []
    for dirpath, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, n), root) for n in names]
    return sorted(f for f in out if f != MARKER)


def manifest(root: str, check: str = "sha256") -> dict[str, dict]:
    """``{relative path: {"size": bytes[, "sha256": hex]}}`` of every file in checkpoint ``root``."""
    if check not in CHECKS:
        raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
    out = {}
    for rel in _files(root):
        path = os.path.join(root, rel)
        out[rel] = {"size": os.path.getsize(path)}
        if check == "sha256":
            out[rel]["sha256"] = _sha256(path)
    return out


def _load_json(path: str, what: str):
    """The JSON in ``path``; CheckpointError naming ``what`` if it cannot be read or parsed."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{what} unreadable ({exc})") from None


def read_marker(path: str) -> dict:
    """The ``COMPLETE`` marker's JSON (step, time, world_size, files); CheckpointError if unreadable."""
    marker = _load_json(os.path.join(path, MARKER), f"{MARKER} marker")
    if not isinstance(marker, dict):
        raise CheckpointError(f"{MARKER} marker is not a JSON object")
    return marker


def saved_at(path: str) -> float:
    """When checkpoint ``path`` began to be written (epoch seconds): everything the run logged
    or traced up to its step happened before, everything of later steps after."""
    try:
        return float(read_marker(path)["time"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        return os.path.getmtime(os.path.join(path, MARKER))   # a checkpoint from before manifests


def verify_checkpoint(path: str, *, check: str = "sha256") -> str | None:
    """What is wrong with checkpoint ``path`` (one phrase), or None when it matches its manifest.

    ``check``: ``size`` compares file sizes (catches truncation, reads no data), ``sha256``
    also compares contents. A checkpoint written before manifests existed gets structural checks
    instead (JSON parses, torch zip archives and safetensors headers are whole).
    """
    try:
        files = read_marker(path).get("files")
    except CheckpointError as exc:
        return str(exc)
    if files is None:
        return _structural_problem(path)
    for rel, meta in files.items():   # sizes first: cheap, and the usual damage
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        size = os.path.getsize(full)
        if size != meta.get("size"):
            return f"{rel} has {size} bytes, the manifest says {meta.get('size')}"
    if check == "sha256":
        for rel, meta in files.items():
            if "sha256" in meta and _sha256(os.path.join(path, rel)) != meta["sha256"]:
                return f"{rel} does not match its sha256 in the manifest"
    return None


def _structural_problem(path: str) -> str | None:
    """Checks for a checkpoint without a manifest: every file of a known kind must be whole."""
    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        return f"{STATE_FILE} is missing"
    for rel in _files(path):
        full = os.path.join(path, rel)
        try:
            if rel.endswith(".json"):
                with open(full) as f:
                    json.load(f)
            elif rel.endswith(".pt"):
                with zipfile.ZipFile(full) as z:   # torch's format: a truncated archive has no directory
                    z.infolist()
            elif rel.endswith(".safetensors"):
                _check_safetensors(full)
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            return f"{rel} is damaged ({type(exc).__name__}: {exc})"
    return None


def _check_safetensors(path: str) -> None:
    """A safetensors file is an 8-byte header length, a JSON header and the data its offsets end at."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if os.path.getsize(path) != 8 + n + end:
        raise ValueError(f"{os.path.getsize(path)} bytes, its header needs {8 + n + end}")


# ---------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------


def _barrier() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(engine: Any, run_dir: str, state: TrainerState, *, tokenizer: Any = None,
                    keep_last: int = 0, check: str = "sha256") -> str:
    """Write ``run_dir/checkpoints/step_<state.step>`` (collective) and prune to ``keep_last``.

    ``tokenizer``: object or model directory for the HF export (None: weights only).
    ``check``: what the manifest records besides sizes (``sha256``: content hashes; ``size``: none).
    Returns the checkpoint path. A checkpoint of the same step is replaced.
    """
    started = time.time()
    root = os.path.join(run_dir, CHECKPOINTS)
    final = os.path.join(root, f"step_{state.step}")
    tmp = os.path.join(root, f".step_{state.step}.tmp")
    me = rank()
    if me == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)   # a leftover from a crashed save
        os.makedirs(os.path.join(tmp, "rng"))
    _barrier()
    engine.save_checkpoint(tmp, tag=DS_TAG, client_state={"trainer_step": state.step})
    export_hf(engine, tokenizer, os.path.join(tmp, "hf"))
    _write_json(os.path.join(tmp, "rng", f"rank_{me}.json"), capture_rng())
    _barrier()
    if me == 0:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        _write_json(os.path.join(tmp, STATE_FILE), {**dataclasses.asdict(state), "world_size": world})
        _write_json(os.path.join(tmp, MARKER), {"step": state.step, "time": started, "world_size": world,
                                                "files": manifest(tmp, check)})
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        prune_checkpoints(run_dir, keep_last)
    _barrier()
    return final


def read_trainer_state(path: str) -> TrainerState:
    """The :class:`TrainerState` stored in checkpoint ``path`` (no weights loaded)."""
    raw = _load_json(os.path.join(path, STATE_FILE), f"{path}: {STATE_FILE}")
    names = {f.name for f in dataclasses.fields(TrainerState)}
    return TrainerState(**{k: v for k, v in raw.items() if k in names})


def load_checkpoint(engine: Any, path: str, *, load_optimizer: bool = True) -> TrainerState:
    """Restore weights, optimizer and LR schedule into ``engine``, this rank's RNG
    states, and return the :class:`TrainerState` (collective). Verify first
    (:func:`resolve_resume`): a damaged file found here is a CheckpointError."""
    if not is_complete(path):
        raise CheckpointError(f"not a complete checkpoint: {path!r}")
    try:
        loaded, _ = engine.load_checkpoint(path, tag=DS_TAG, load_optimizer_states=load_optimizer,
                                           load_lr_scheduler_states=load_optimizer)
    except Exception as exc:   # torch.load / DeepSpeed errors are long; one line names the file's fault
        raise CheckpointError(f"{path}: DeepSpeed could not load it ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    if loaded is None:
        raise CheckpointError(f"{path}: DeepSpeed found no loadable state in it")
    rng_file = os.path.join(path, "rng", f"rank_{rank()}.json")
    if os.path.isfile(rng_file):   # absent when resuming with more ranks than were saved
        try:
            with open(rng_file) as f:
                restore_rng(json.load(f))
        except ValueError as exc:
            raise CheckpointError(f"{path}: {os.path.relpath(rng_file, path)} unreadable ({exc})") from None
    return read_trainer_state(path)
