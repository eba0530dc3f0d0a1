"""Rewinding a run's records to the step it restarts from: TensorBoard files, traces, episode files.

Duplicates are counted in the raw event files: TensorBoard's EventAccumulator hides a
step logged twice (it purges out-of-order steps), so reading through it proves nothing."""
import json
import os

from aflow_rl.trainer.logger import TBLogger
from aflow_rl.trainer.records import rewind, rewind_episodes, rewind_events, rewind_traces


def raw_records(log_dir):
    """[(tag, step)] of every scalar/text/histogram record in every event file, in file order."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = []
    for name in sorted(os.listdir(log_dir)):
        for event in EventFileLoader(os.path.join(log_dir, name)).Load():
            for value in event.summary.value:
                out.append((value.tag, event.step))
    return out


def log_steps(run, steps, purge_step=None):
    with TBLogger(run, purge_step=purge_step) as tb:
        tb.hparams({"lr": 1e-3})
        for s in steps:
            tb.scalars({"rewards/mean": float(s), "losses/policy": -float(s)}, s)
            tb.text("samples/episode", f"step {s}", s)


def test_restart_after_checkpoint_logs_every_step_once(tmp_path):
    run = str(tmp_path)
    log_steps(run, [1, 2, 3, 4])                       # the first attempt got to step 4
    assert rewind_events(os.path.join(run, "events"), 2) == 6   # checkpoint at step 2: steps 3, 4 go (3 tags each)
    log_steps(run, [3, 4, 5], purge_step=3)            # the resumed run
    records = raw_records(os.path.join(run, "events"))
    scalars = [r for r in records if r[0] == "rewards/mean"]
    assert sorted(scalars) == [("rewards/mean", s) for s in (1, 2, 3, 4, 5)]
    assert len(records) == len(set(records))           # no (tag, step) twice, hyper-parameters included
    assert sum(tag.startswith("_hparams_") for tag, _ in records) == 3   # the resumed run's set only


def test_restart_before_first_checkpoint_drops_the_earlier_attempt(tmp_path):
    run = str(tmp_path)
    log_steps(run, [1, 2])
    events = os.path.join(run, "events")
    assert rewind_events(events, 0) == 6
    assert os.listdir(events) == []                    # a file with nothing left is deleted
    assert rewind_events(events, 0) == 0               # idempotent


def test_a_record_cut_short_by_a_kill_is_dropped(tmp_path):
    run = str(tmp_path)
    log_steps(run, [1, 2, 3])
    path = os.path.join(run, "events", os.listdir(os.path.join(run, "events"))[0])
    with open(path, "ab") as fh:
        fh.write(b"\x20\x00\x00\x00\x00\x00")          # half of a record header
    rewind_events(os.path.join(run, "events"), 2)
    assert sorted(r for r in raw_records(os.path.join(run, "events")) if r[0] == "rewards/mean") == [
        ("rewards/mean", 1), ("rewards/mean", 2)]


def test_traces_keep_what_was_written_before_the_checkpoint(tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    lines = [json.dumps({"ts": t, "episode_id": f"e{t}", "step": 0}) + "\n" for t in (10.0, 20.0, 30.0)]
    (folder / "worker-1.jsonl").write_text("".join(lines) + '{"ts": 40.0, "episode')   # torn last line
    (folder / "worker-2.jsonl").write_text(lines[2])
    assert rewind_traces(str(folder), since=25.0) == 3
    assert (folder / "worker-1.jsonl").read_text() == "".join(lines[:2])
    assert not (folder / "worker-2.jsonl").exists()
    assert rewind_traces(str(folder), since=None) == 2                  # no checkpoint: nothing kept
    assert os.listdir(folder) == []


def test_episode_files_of_later_steps_go(tmp_path):
    folder = tmp_path / "episodes"
    folder.mkdir()
    for k in range(5):
        (folder / f"step_{k:06d}.jsonl").write_text("{}\n")
    (folder / "notes.txt").write_text("kept")
    assert rewind_episodes(str(folder), 3) == 2                         # 0-based steps 3 and 4
    assert sorted(os.listdir(folder)) == ["notes.txt"] + [f"step_{k:06d}.jsonl" for k in range(3)]


def test_rewind_reports_what_went(tmp_path):
    run = str(tmp_path)
    log_steps(run, [1, 2])
    got = rewind(run, 5, since=None)                   # nothing past step 5; no traces or episodes folder
    assert not got.any and str(got) == "0 TensorBoard record(s), 0 trace event(s) and 0 episode file(s)"
