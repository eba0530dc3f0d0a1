"""train.py end to end, as a user runs it: a subprocess, real servers, pool, DeepSpeed, TensorBoard."""
import glob
import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from aflow_rl.trainer.learner import clean_dist_env
from tests.leftovers import kill_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Other tests set up a process group in this interpreter; train.py must start its own.
ENV = clean_dist_env()

# The metric tags (docs/architecture.md) that every swarm run must write.
REQUIRED_TAGS = [
    "rewards/mean", "rewards/std", "rewards/r_perf/mean", "rewards/r_parallel/mean", "rewards/r_finish/mean",
    "rewards/format/mean", "losses/policy", "losses/kl", "losses/clipfrac", "losses/entropy", "losses/grad_norm",
    "charts/lr", "episode/critical_steps", "episode/item_f1", "episode/avg_parallelism", "timing/rollout_s",
    "timing/train_s", "timing/sync_s", "perf/tokens_per_s", "perf/logprob_mismatch", "pool/retries", "pool/failed",
    "async/staleness_mean", "async/staleness_max", "async/queue_episodes", "async/admission_wait_s", "timing/overlap",
]


def train_cmd(run_dir, model_dir, *overrides):
    return [sys.executable, "train.py", "configs/test.yaml", f"run.dir={run_dir}",
            f"serving.policy.model_path={model_dir}", *overrides]


def scalars(run_dir):
    acc = EventAccumulator(os.path.join(run_dir, "events"), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def test_smoke_run_writes_events_checkpoint_trace_and_config(tmp_path, tiny_model_dir):
    run_dir = str(tmp_path / "run")
    proc = subprocess.run(train_cmd(run_dir, tiny_model_dir), cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    acc = scalars(run_dir)
    tags = set(acc.Tags()["scalars"])
    missing = [t for t in REQUIRED_TAGS if t not in tags]
    assert not missing, f"missing tags {missing}; have {sorted(tags)}"
    assert [e.step for e in acc.Scalars("rewards/mean")] == [1, 2]   # one x-axis: the optimizer step
    # The synchronous loop (max_staleness 0): every turn sampled by the weights it is trained on.
    assert [e.value for e in acc.Scalars("async/staleness_max")] == [0.0, 0.0]
    assert [e.value for e in acc.Scalars("timing/overlap")] == [0.0, 0.0]
    assert acc.Tags()["histograms"] and acc.Tags()["tensors"]        # advantages histogram, text samples

    ckpt = os.path.join(run_dir, "checkpoints", "step_2")
    assert os.path.isfile(os.path.join(ckpt, "COMPLETE"))
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    assert state["step"] == 2 and state["sampler"]["position"] == 4       # 2 steps x 2 tasks
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(os.path.join(ckpt, "hf")).config.model_type == "qwen2"

    traces = glob.glob(os.path.join(run_dir, "traces", "*.jsonl"))
    events = [json.loads(line) for path in traces for line in open(path)]
    assert events and all("episode_id" in e for e in events)
    episodes = [json.loads(line) for line in open(os.path.join(run_dir, "episodes", "step_000000.jsonl"))]
    assert len(episodes) == 4 and all(e["status"] == "ok" for e in episodes)

    resolved = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    assert resolved["run"]["dir"] == run_dir and resolved["trainer"]["max_steps"] == 2
    assert not os.listdir(os.path.join(run_dir, "logs")) == []                # the server's log


def test_killed_run_resumes_from_last_checkpoint(tmp_path, tiny_model_dir):
    run_dir = str(tmp_path / "run")
    args = train_cmd(run_dir, tiny_model_dir, "trainer.max_steps=3", "trainer.save_every=1")
    # Run until the step-2 checkpoint is complete, then kill the whole process tree.
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=ENV)
    marker = os.path.join(run_dir, "checkpoints", "step_2", "COMPLETE")
    deadline = time.monotonic() + 600
    while not os.path.exists(marker):
        assert proc.poll() is None, "training exited before its second checkpoint"
        assert time.monotonic() < deadline, "no second checkpoint within 10 minutes"
        time.sleep(0.1)
    kill_tree(proc)  # all of it: the run's server is in a session of its own, out of a killpg's reach
    assert not os.path.exists(os.path.join(run_dir, "checkpoints", "step_3"))

    again = subprocess.run(args + ["resume=auto"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-4000:]
    assert f"resumed from step 2 at {os.path.join(run_dir, 'checkpoints', 'step_2')}" in again.stdout

    state = json.load(open(os.path.join(run_dir, "checkpoints", "step_3", "trainer_state.json")))
    assert state["step"] == 3 and state["sampler"]["position"] == 6        # no task drawn twice or skipped
    steps = sorted({e.step for e in scalars(run_dir).Scalars("rewards/mean")})
    assert steps == [1, 2, 3]
    # The resumed run's episodes continue the numbering: step 2 (0-based) written once, by the second run.
    assert os.path.exists(os.path.join(run_dir, "episodes", "step_000002.jsonl"))

    # A third run of the finished config starts nothing and says how to continue.
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 0 and "is complete" in done.stdout and "trainer.max_steps=3" in done.stdout
    assert "resumed from" not in done.stdout   # no engine, server or pool was started to do nothing


@pytest.mark.parametrize("args,message", [
    (["configs/test.yaml", "trainer.lrr=1"], "unknown config key 'trainer.lrr': did you mean 'trainer.lr'?"),
    (["configs/nope.yaml"], "config file not found: configs/nope.yaml"),
    (["configs/test.yaml", "rollout.workers=two"], "rollout.workers: expected int, got 'two'"),
    (["configs/test.yaml", "env.name=no_such_env"], "env.name: unknown environment 'no_such_env'; choose swarm"),
    (["configs/test.yaml", "env.name=no_such_pkg.env"], "env.name='no_such_pkg.env': cannot import worker module 'no_such_pkg.env'"),
    (["configs/test.yaml", "env.name=json"], "env.name='json': worker module json ("),
    (["configs/test.yaml", "rollout.worker=workers.aflow_worker:run_episode"],
     "rollout.worker was removed: set env.name: aflow"),
    (["configs/test.yaml", "env.mode=plan_act"], "env.mode was removed: set env.name: plan_act"),
])
def test_bad_config_is_one_line_error(args, message):
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"config error: {message}"), lines


def test_unreachable_external_server_is_a_clear_error(tmp_path, tiny_model_dir):
    import socket

    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(train_cmd(str(tmp_path / "run"), tiny_model_dir, "serving.policy.backend=external",
                                    f"serving.policy.urls=[http://127.0.0.1:{port}]"),
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ServerError") and f"127.0.0.1:{port}" in last
