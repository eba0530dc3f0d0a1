"""Rewind a run's records to the step it restarts from, so no step is recorded twice.

A run that stops after checkpoint N but before its end has already written
TensorBoard records, step traces and episode files of steps past N. The resumed
run (or, with no checkpoint, the run that starts over at step 0) writes them
again, so before it starts:

- ``events/``: every TensorBoard record at a step above N is dropped from the
  earlier event files, which are rewritten (a file left with nothing is
  deleted); so are the earlier hyper-parameters (step 0), which the new run
  writes again. The new writer also gets ``purge_step=N+1`` so a TensorBoard
  that already loaded the old records drops them too.
- ``traces/``: every event written after checkpoint N began (its manifest's
  ``time``) is dropped; all of them when starting over. Trace events carry no
  training step, but each rollout starts after the previous checkpoint is
  written, so the time splits them exactly (on one clock: the workers' machine).
- ``episodes/``: the files of steps N and later are deleted, except in asynchronous mode
  (``keep_episodes``): there they hold completed episodes not yet trained, which the resumed
  rollout reuses (aflow_rl/trainer/episode_files.py).

TensorBoard logs step ``k`` for the state after ``k`` optimizer steps (1-based),
episode files are numbered by the 0-based step that produced them.
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass

_EPISODE_FILE = re.compile(r"^step_(\d+)\.jsonl$")


@dataclass
class Rewound:
    """What :func:`rewind` removed: TensorBoard records, trace events, episode files."""

    events: int = 0
    traces: int = 0
    episodes: int = 0

    @property
    def any(self) -> bool:
        return bool(self.events or self.traces or self.episodes)

    def __str__(self) -> str:
        return (f"{self.events} TensorBoard record(s), {self.traces} trace event(s) and "
                f"{self.episodes} episode file(s)")


def rewind(run_dir: str, step: int, since: float | None, keep_episodes: bool = False) -> Rewound:
    """Drop every record of ``run_dir`` that belongs to a step after ``step`` (see the module
    docstring). ``since``: when the checkpoint of ``step`` began to be written (None: no
    checkpoint, every trace event goes). ``keep_episodes``: leave the episode files (async mode).
    Call on rank 0 before any writer of the run starts."""
    return Rewound(events=rewind_events(os.path.join(run_dir, "events"), step),
                   traces=rewind_traces(os.path.join(run_dir, "traces"), since),
                   episodes=0 if keep_episodes else rewind_episodes(os.path.join(run_dir, "episodes"), step))


def rewind_events(log_dir: str, step: int) -> int:
    """Keep the records at steps 1..``step`` of every event file in ``log_dir``; returns how many
    records of later steps went."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    dropped = 0
    for path in sorted(glob.glob(os.path.join(log_dir, "*tfevents*"))):
        header, kept, gone, later = None, [], 0, 0
        for raw in RawEventFileLoader(path).Load():   # a record cut short by a kill ends the file
            event = Event.FromString(raw)
            if event.HasField("file_version"):
                header = header or raw
            elif 0 < event.step <= step:
                kept.append(raw)
            else:
                gone += 1
                later += event.step > step   # step 0 (hyper-parameters) is written again, not lost
        if not gone:
            continue
        dropped += later
        if not kept:
            os.remove(path)
            continue
        tmp = path + ".rewind"
        with open(tmp, "wb") as fh:
            writer = RecordWriter(fh)
            for raw in ([header] if header else []) + kept:
                writer.write(raw)
            writer.flush()
        os.replace(tmp, path)
    return dropped


def rewind_traces(trace_dir: str, since: float | None) -> int:
    """Keep the trace events written before ``since`` (None: keep none); returns how many went.
    Lines that do not parse (a worker killed mid-line) go too."""
    dropped = 0
    for path in sorted(glob.glob(os.path.join(trace_dir, "*.jsonl"))):
        kept, gone = [], 0
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if since is not None and _trace_time(line) < since:
                    kept.append(line)
                else:
                    gone += 1
        if not gone:
            continue
        dropped += gone
        if not kept:
            os.remove(path)
            continue
        with open(path + ".rewind", "w", encoding="utf-8") as fh:
            fh.writelines(kept)
        os.replace(path + ".rewind", path)
    return dropped


def _trace_time(line: str) -> float:
    try:
        return float(json.loads(line)["ts"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


def rewind_episodes(episode_dir: str, step: int) -> int:
    """Delete ``step_<k>.jsonl`` for every 0-based step ``k >= step``; returns how many."""
    if not os.path.isdir(episode_dir):
        return 0
    gone = 0
    for name in os.listdir(episode_dir):
        m = _EPISODE_FILE.match(name)
        if m and int(m.group(1)) >= step:
            os.remove(os.path.join(episode_dir, name))
            gone += 1
    return gone
