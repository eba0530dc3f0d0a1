"""TensorBoard event files under ``run_dir/events``, written by rank 0 only.

Tags follow the namespaces of docs/architecture.md (Metric tags) (``rewards/``, ``losses/``, ``charts/``,
``episode/``, ``timing/``, ``perf/``, ``pool/``), all against one x-axis: the
optimizer step. On other ranks every method is a no-op, so the training loop
calls them unconditionally.

    tb = TBLogger(run_dir, rank=dist.rank)
    tb.hparams(config_dict, metrics=["rewards/mean"])
    tb.scalars({"rewards/mean": 0.4, "losses/policy": -0.1}, step)
    tb.text("samples/episode_0", trace_text, step)
    tb.histogram("rewards/advantages", advantages, step)
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping

import numpy as np


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> ``{"a.b": value}``; values TensorBoard's HParams can show
    (bool, int, float, str); lists and None become strings."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


class TBLogger:
    """A ``SummaryWriter`` on rank 0 and nothing elsewhere."""

    def __init__(self, run_dir: str, *, rank: int = 0, flush_secs: int = 10, purge_step: int | None = None):
        """``purge_step``: the first step this writer logs when a run restarts; TensorBoard
        then drops the records of that step and later that it loaded from earlier files
        (:mod:`aflow_rl.trainer.records` removes them from the files themselves)."""
        self.log_dir = os.path.join(run_dir, "events")
        self.writer = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(self.log_dir, exist_ok=True)
            self.writer = SummaryWriter(log_dir=self.log_dir, flush_secs=flush_secs, purge_step=purge_step)

    @property
    def enabled(self) -> bool:
        return self.writer is not None

    def scalars(self, values: Mapping[str, Any], step: int) -> None:
        """One scalar per tag; None is skipped, NaN/inf are written as they are."""
        if not self.writer:
            return
        for tag, value in values.items():
            if value is None:
                continue
            self.writer.add_scalar(tag, float(value), global_step=step)

    def text(self, tag: str, text: str, step: int, *, verbatim: bool = True) -> None:
        """A text sample. TensorBoard renders markdown; ``verbatim`` indents every line
        by four spaces (a markdown code block) so JSON and traces show as written."""
        if not self.writer:
            return
        if verbatim:
            text = "\n".join("    " + line for line in text.splitlines())
        self.writer.add_text(tag, text, global_step=step)

    def histogram(self, tag: str, values: Iterable[float] | np.ndarray, step: int) -> None:
        """Distribution of ``values`` (non-finite entries dropped; nothing if none is left)."""
        if not self.writer:
            return
        arr = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=np.float64).ravel()
        arr = arr[np.isfinite(arr)]
        if arr.size:
            self.writer.add_histogram(tag, arr, global_step=step)

    def hparams(self, params: Mapping[str, Any], metrics: Iterable[str] = ("rewards/mean",)) -> None:
        """Hyperparameters (nested mappings are flattened to dotted keys) for the HParams tab,
        linked to the scalar tags in ``metrics``; written into this run's own event file."""
        if not self.writer:
            return
        from torch.utils.tensorboard.summary import hparams

        flat = flatten(params)
        exp, ssi, sei = hparams(flat, {m: math.nan for m in metrics})
        fw = self.writer._get_file_writer()
        for summary in (exp, ssi, sei):
            fw.add_summary(summary)

    def flush(self) -> None:
        if self.writer:
            self.writer.flush()

    def close(self) -> None:
        if self.writer:
            self.writer.close()
            self.writer = None

    def __enter__(self) -> "TBLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
