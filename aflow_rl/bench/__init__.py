"""Benchmarks, run as ``python -m aflow_rl.bench.<name>``; results go to docs/benchmarks.md.

Every benchmark prints the machine it ran on (``machine()``) next to its numbers.
"""
from __future__ import annotations

import json
import os
import platform


def machine(**extra: object) -> dict:
    """Where the numbers were measured: platform, CPU model, usable cores, Python, torch, GPU."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {"platform": platform.platform(), "cpu": cpu, "cores": cores, "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except ImportError:
        pass
    info.update(extra)
    return info


def write_json(result: object, path: str) -> str:
    """Write a benchmark's result to ``path`` (folders made as needed); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2, default=str)
    return path
