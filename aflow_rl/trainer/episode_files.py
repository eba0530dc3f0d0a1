"""The run's episode files in asynchronous mode: each episode on disk the moment it completes, and
the completed ones read back when a killed run resumes.

``run.dir/episodes/step_<t>.jsonl`` holds the episodes of the chunk trained at 0-based step ``t``
(the same files as the synchronous loop, which writes a step's file once its rollout ends). In
asynchronous mode a chunk runs while earlier steps train, so a kill can leave chunks complete or
half done but untrained; the resumed run draws the same tasks again (the sampler resumes at the
checkpoint's position, and episode ids are derived from the tasks) and
:class:`ResumingPool` hands back the episodes already on disk instead of running them: no
completed episode is lost, and none is in two batches of the resumed run.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable, Iterator

from aflow_rl.rollout.types import Trajectory


def episode_path(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "episodes", f"step_{step:06d}.jsonl")


def load_completed(run_dir: str, step: int) -> dict[str, Trajectory]:
    """The episodes of step ``step`` already on disk, by episode id (a later line of the same
    episode, from a retried rollout, replaces the earlier). A line cut short by a kill is skipped."""
    path = episode_path(run_dir, step)
    done: dict[str, Trajectory] = {}
    if not os.path.exists(path):
        return done
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                traj = Trajectory.from_dict(json.loads(line))
            except (ValueError, TypeError, KeyError):
                continue   # the last line of a killed run: that episode runs again
            done[traj.episode_id] = traj
    return done


class EpisodeAppender:
    """Appends each episode to its step's file as one JSON line, flushed at once: a SIGKILL of the
    trainer cannot lose it (the OS holds it; power loss is not covered, there is no fsync)."""

    def __init__(self, run_dir: str, step: int):
        self.path = episode_path(run_dir, step)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        # A kill mid-write leaves a last line without its newline: end it, or the next episode
        # would be glued to it and lost with it.
        if os.path.exists(self.path) and os.path.getsize(self.path):
            with open(self.path, "rb+") as fh:
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")

    def __call__(self, traj: Trajectory) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(traj.to_dict(), default=str) + "\n")
            fh.flush()


class ResumingPool:
    """A RolloutPool seen through its public ``run``/``stats``: the first ``run`` yields the
    episodes in ``done`` without running them and runs the rest, each new one passed to ``save``
    as soon as it is final; later runs (rollout retries of the same chunk) run everything."""

    def __init__(self, pool: Any, done: dict[str, Trajectory], save: Callable[[Trajectory], None]):
        self.pool, self.done, self.save = pool, dict(done), save
        self.stats: dict[str, float] = {}

    def run(self, episodes: Iterable[dict]) -> Iterator[Trajectory]:
        done, self.done = self.done, {}
        episodes = list(episodes)
        todo = [e for e in episodes if str(e["episode_id"]) not in done]
        for e in episodes:
            if str(e["episode_id"]) in done:
                yield done[str(e["episode_id"])]
        self.stats = {}
        if todo:
            for traj in self.pool.run(todo):
                self.save(traj)
                yield traj
            self.stats = dict(self.pool.stats)
