"""train.py with trainer.max_staleness=1, end to end: killed with SIGKILL mid-run while completed
episodes wait untrained, then resumed: no completed episode lost, none run or trained twice."""
import json
import os
import subprocess
import sys
import time

import pytest

from aflow_rl.trainer.learner import clean_dist_env
from tests.leftovers import kill_tree
from tests.test_train_faults import assert_each_step_once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = clean_dist_env()


def episode_lines(run_dir, step):
    path = os.path.join(run_dir, "episodes", f"step_{step:06d}.jsonl")
    return open(path).read().splitlines() if os.path.exists(path) else []


@pytest.mark.slow   # two runs of configs/test.yaml: 176 s under nice at load 8-13 on 2 cores
def test_async_run_killed_with_sigkill_resumes_without_losing_or_repeating_episodes(tmp_path, tiny_model_dir):
    run_dir = str(tmp_path / "run")
    args = [sys.executable, "train.py", "configs/test.yaml", f"run.dir={run_dir}",
            f"serving.policy.model_path={tiny_model_dir}", "trainer.max_staleness=1", "trainer.max_steps=4",
            "trainer.save_every=1"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=ENV)
    marker = os.path.join(run_dir, "checkpoints", "step_2", "COMPLETE")
    deadline = time.monotonic() + 300
    try:
        # Checkpoint 2 written and step 2's chunk complete on disk (k=1: it ran during step 1's training).
        while not (os.path.exists(marker) and len(episode_lines(run_dir, 2)) == 4):
            assert proc.poll() is None, "training exited before its second checkpoint"
            assert time.monotonic() < deadline, "no second checkpoint within 5 minutes"
            time.sleep(0.05)
    finally:
        kill_tree(proc)   # SIGKILL to the trainer, its workers and its server
    before = {step: episode_lines(run_dir, step) for step in range(4)}
    assert not os.path.exists(os.path.join(run_dir, "checkpoints", "step_4"))

    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-4000:]
    out = again.stdout + again.stderr
    resumed = 3 if os.path.exists(os.path.join(run_dir, "checkpoints", "step_3", "COMPLETE")) and \
        "resumed from step 3" in out else 2
    assert f"resumed from step {resumed}" in out
    # The completed chunk of step `resumed` was reused, not run again: its file is unchanged.
    assert f"step {resumed + 1}: {len(before[resumed])} completed episode(s) on disk from before the restart " \
           "are reused" in out
    assert episode_lines(run_dir, resumed) == before[resumed]
    for step in range(4):
        ids = [json.loads(line)["episode_id"] for line in episode_lines(run_dir, step) if _parses(line)]
        assert len(ids) == 4 and len(set(ids)) == 4, (step, ids)           # each ran once, none lost
        kept = [line for line in before[step] if _parses(line)]
        assert episode_lines(run_dir, step)[:len(kept)] == kept            # what was on disk stays
    assert not os.path.exists(os.path.join(run_dir, "episodes", "step_000004.jsonl"))   # no chunk past the end
    state = json.load(open(os.path.join(run_dir, "checkpoints", "step_4", "trainer_state.json")))
    assert state["step"] == 4 and state["sampler"]["position"] == 8        # no task drawn twice or skipped
    assert_each_step_once(run_dir, 4)
    from tests.test_train import scalars   # the real server's weight versions, as trained
    lags = [e.value for e in scalars(run_dir).Scalars("async/staleness_max")]
    assert len(lags) == 4 and all(0 <= lag <= 1 for lag in lags), lags
    for step in range(4):   # and per turn, from the episode files: sampled at most k=1 versions back
        versions = [t["policy_version"] for line in episode_lines(run_dir, step) if _parses(line)
                    for t in json.loads(line)["turns"]]
        assert versions and all(step - 1 <= v <= step for v in versions), (step, versions)


def _parses(line):
    try:
        json.loads(line)
        return True
    except ValueError:
        return False
