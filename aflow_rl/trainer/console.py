"""What a training run prints: one progress bar, its own messages, no third-party noise.

    quiet_libraries()                 # before torch extensions, DeepSpeed or transformers are used
    interrupted_line(cfg, script, argv)   # Ctrl-C: where the last checkpoint is and the command to resume

``train.py`` draws the only progress bar; the libraries under it each have their
own: transformers' "Loading weights" and "Writing model shards" (one per
checkpoint and weight sync, which break the training bar into fragments), and
torch's ``No CUDA runtime is found`` warning, emitted by
``torch.utils.cpp_extension`` on a machine with the CUDA toolkit (or a CUDA
build of torch) but no GPU, when DeepSpeed looks for its op builders. A CPU run
builds no CUDA extension, so the warning says nothing it can act on.
"""
from __future__ import annotations

import logging
import os
import shlex
from typing import Any

CUDA_WARNING = "No CUDA runtime is found"


class _DropCudaRuntimeWarning(logging.Filter):
    """Drops torch.utils.cpp_extension's CUDA_HOME notice on a machine without a GPU."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(CUDA_WARNING)


def quiet_libraries(cuda_available: bool) -> None:
    """Silence the libraries' own progress bars and, on CPU, the CUDA-runtime warning.

    Idempotent; call it in the process that trains, before DeepSpeed is imported.
    """
    logger = logging.getLogger("torch.utils.cpp_extension")
    if not cuda_available:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")   # DeepSpeed's accelerator probe and its warning
        if not any(isinstance(f, _DropCudaRuntimeWarning) for f in logger.filters):
            logger.addFilter(_DropCudaRuntimeWarning())
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # the training bar is the only bar


# ---------------------------------------------------------------------------
# Ctrl-C
# ---------------------------------------------------------------------------


def resume_command(script: str, argv: list[str], resume: str) -> str:
    """The command line that continues this run from its newest checkpoint: the same
    arguments, with ``resume=auto`` instead of any other ``resume`` setting."""
    args = [a for a in argv if not a.startswith("resume=")]
    if resume != "auto":
        args.append("resume=auto")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launcher = ["torchrun", f"--nproc_per_node={world}"] if os.environ.get("TORCHELASTIC_RUN_ID") else ["python"]
    return shlex.join([*launcher, script, *args])


def interrupted_line(cfg: Any, script: str, argv: list[str]) -> str:
    """One line after Ctrl-C: the newest complete checkpoint and how to go on from it."""
    from aflow_rl.trainer.checkpoint import list_checkpoints, step_of

    found = list_checkpoints(cfg.run_dir)
    command = resume_command(script, argv, cfg.resume)
    if not found:
        return (f"interrupted before the first checkpoint of {cfg.run_dir} (trainer.save_every="
                f"{cfg.trainer.save_every}): nothing kept; start again with: {command}")
    last = found[-1]
    return (f"interrupted: last checkpoint {last} (step {step_of(last)} of {cfg.trainer.max_steps}); "
            f"resume with: {command}")
