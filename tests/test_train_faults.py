"""train.py under faults, as a user meets them: Ctrl-C, a restart before the first checkpoint,
a policy server that dies mid-run. Each test launches real runs of configs/test.yaml."""
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from aflow_rl.trainer.learner import clean_dist_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = clean_dist_env()   # other tests set up a process group in this interpreter


def train_cmd(run_dir, model_dir, *overrides):
    return [sys.executable, "train.py", "configs/test.yaml", f"run.dir={run_dir}",
            f"serving.policy.model_path={model_dir}", *overrides]


def raw_records(run_dir):
    """[(tag, step)] of every summary record in every event file of the run. Read raw: TensorBoard's
    EventAccumulator hides a step written twice (it purges out-of-order steps)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    folder = os.path.join(run_dir, "events")
    return [(v.tag, e.step) for name in sorted(os.listdir(folder))
            for e in EventFileLoader(os.path.join(folder, name)).Load() for v in e.summary.value]


def assert_each_step_once(run_dir, steps):
    records = raw_records(run_dir)
    dupes = sorted({r for r in records if records.count(r) > 1})
    assert not dupes, f"recorded twice: {dupes[:10]}"
    assert sorted(s for t, s in records if t == "rewards/mean") == list(range(1, steps + 1))


def _reset_sigint():
    """A child started from a shell that ignores SIGINT (nohup, `&`) would inherit that; Python then
    installs no KeyboardInterrupt handler. A terminal's Ctrl-C reaches a foreground run, so restore it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def _reaped(proc):
    """On the way out (a failed assertion included) the run and its process group are gone; its
    servers, in sessions of their own, stop with it (stop() or their parent-death signal)."""
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)   # train.py's servers stop on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_for(path, proc, timeout_s=600):
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert proc.poll() is None, f"training exited (code {proc.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"no {path} within {timeout_s}s"
        time.sleep(0.1)


def _lines(text):
    """Terminal lines of captured output (tqdm redraws with carriage returns)."""
    return [line for line in text.replace("\r", "\n").splitlines() if line.strip()]


@pytest.mark.slow   # two runs (~55 s on 2 loaded cores); tests/trainer/test_records.py covers the rewind alone
def test_ctrl_c_says_what_was_kept_and_the_restart_records_each_step_once(tmp_path, tiny_model_dir):
    run_dir = str(tmp_path / "run")
    # The only checkpoint is the last (step 2); Ctrl-C comes while step 2 trains, before it.
    args = train_cmd(run_dir, tiny_model_dir, "trainer.max_steps=2", "trainer.save_every=2")
    err_path = tmp_path / "stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=ENV,
                                preexec_fn=_reset_sigint, start_new_session=True)
        with _reaped(proc):
            # Step 2's episodes are on disk, so step 1 is in TensorBoard: there is something to duplicate.
            _wait_for(os.path.join(run_dir, "episodes", "step_000001.jsonl"), proc)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=120) == 130
    stderr = err_path.read_text()
    assert "Traceback" not in stderr, stderr[-3000:]
    assert _lines(stderr)[-1] == (
        f"interrupted before the first checkpoint of {run_dir} (trainer.save_every=2): nothing kept; start again "
        f"with: python train.py configs/test.yaml run.dir={run_dir} serving.policy.model_path={tiny_model_dir} "
        "trainer.max_steps=2 trainer.save_every=2")
    assert ("rewards/mean", 1) in raw_records(run_dir)
    assert not os.path.exists(os.path.join(run_dir, "checkpoints", "step_2"))

    restarted = time.time()
    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-4000:]
    first = again.stdout.splitlines()[0]
    assert first.startswith(f"started fresh at step 0 (no checkpoint in {run_dir}); dropped the earlier "
                            "attempt's ") and "TensorBoard record(s)" in first, first
    assert_each_step_once(run_dir, 2)
    traces = [json.loads(line) for path in glob.glob(os.path.join(run_dir, "traces", "*.jsonl")) for line in open(path)]
    assert traces and all(e["ts"] >= restarted for e in traces)       # the interrupted attempt's events are gone
    assert sorted(os.listdir(os.path.join(run_dir, "episodes"))) == [f"step_{k:06d}.jsonl" for k in range(2)]


def _children(pid):
    """PIDs of the processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(entry))
    return out


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_dead_policy_server_stops_the_run_without_a_checkpoint(tmp_path, tiny_model_dir):
    run_dir = str(tmp_path / "run")
    # No weight sync (its failure would stop the run first) and no per-episode retries, so the failed
    # rollout comes back fast; with its server dead the step is not retried (nothing brings it back).
    args = train_cmd(run_dir, tiny_model_dir, "trainer.max_steps=4", "trainer.save_every=1", "trainer.sync_every=100",
                     "rollout.max_attempts=1", "llm.policy.max_retries=0")
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)
    with _reaped(proc):
        _wait_for(os.path.join(run_dir, "checkpoints", "step_1", "COMPLETE"), proc)
        servers = [p for p in _children(proc.pid) if "aflow_rl.serving.embedded" in _cmdline(p)]
        assert len(servers) == 1, [_cmdline(p) for p in _children(proc.pid)]
        os.kill(servers[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-2000:] + err[-3000:]
    last = _lines(err)[-1]
    assert last.startswith("error: RunFailed: step ") and " cannot learn: every episode failed" in last, last
    assert "policy server 0" in last and "is dead (exit code -9)" in last, last
    assert "Traceback" not in err and "done:" not in out
    failed_step = int(last.split("step ")[1].split()[0])
    saved = [int(name.split("_")[1]) for name in os.listdir(os.path.join(run_dir, "checkpoints"))
             if name.startswith("step_")]
    assert saved and max(saved) < failed_step, (saved, last)   # nothing of the failed step was saved
