"""Checkpoints: exact restore of weights, optimizer, schedule, RNG and trainer state;
completeness, pruning, resume resolution; manifests and the fallback past a damaged
checkpoint; the Hugging Face export."""
import json
import os
import random

import numpy as np
import pytest
import torch

from aflow_rl.config import AlgoConfig, TrainerConfig
from aflow_rl.rollout.types import Turn
from aflow_rl.trainer.checkpoint import (CheckpointError, TrainerState, capture_rng, latest_checkpoint,
                                         list_checkpoints, load_checkpoint, manifest, prune_checkpoints,
                                         read_trainer_state, resolve_resume, restore_rng, save_checkpoint,
                                         verify_checkpoint)
from aflow_rl.trainer.learner import build_engine, train_step
from aflow_rl.trainer.weights import export_hf


def make_turns(seed):
    rng = np.random.default_rng(seed)
    return [Turn(prompt_ids=rng.integers(3, 1000, 5), response_ids=rng.integers(3, 1000, 3),
                 logprobs=np.full(3, -6.9)) for _ in range(4)]


def params(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


def fake_checkpoint(run_dir, name, complete=True):
    """A checkpoint directory with a trainer state and (if complete) a marker holding its manifest."""
    path = os.path.join(run_dir, "checkpoints", name)
    os.makedirs(path)
    json.dump({"step": 0}, open(os.path.join(path, "trainer_state.json"), "w"))
    if complete:
        json.dump({"step": 0, "time": 0.0, "files": manifest(path)}, open(os.path.join(path, "COMPLETE"), "w"))
    return path


def test_rng_roundtrip():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = json.loads(json.dumps(capture_rng()))                      # survives JSON
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def test_latest_ignores_incomplete_and_temporary(tmp_path):
    run = str(tmp_path)
    assert latest_checkpoint(run) is None
    fake_checkpoint(run, "step_2")
    fake_checkpoint(run, "step_10")
    fake_checkpoint(run, "step_12", complete=False)                   # crashed before its marker
    fake_checkpoint(run, ".step_14.tmp")                              # being written
    fake_checkpoint(run, "notes")
    assert latest_checkpoint(run).endswith("step_10")                  # numeric, not lexical order
    assert [os.path.basename(p) for p in list_checkpoints(run)] == ["step_2", "step_10"]


def test_prune_keeps_last_and_drops_temporaries(tmp_path):
    run = str(tmp_path)
    for s in (1, 2, 3, 4):
        fake_checkpoint(run, f"step_{s}")
    fake_checkpoint(run, ".step_5.tmp")
    prune_checkpoints(run, keep_last=2)
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["step_3", "step_4"]
    prune_checkpoints(run, keep_last=0)                                # 0 keeps all
    assert len(list_checkpoints(run)) == 2


def test_resolve_resume(tmp_path):
    run = str(tmp_path / "run")
    assert resolve_resume("auto", run) is None                         # fresh run
    assert resolve_resume("never", run) is None
    ck = fake_checkpoint(run, "step_3")
    assert resolve_resume("auto", run) == ck
    assert resolve_resume("never", run) is None
    assert resolve_resume(ck, "/elsewhere") == ck
    assert resolve_resume(run, "/elsewhere") == ck                     # a run dir means its newest
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resolve_resume(str(tmp_path / "nope"), run)
    bad = fake_checkpoint(run, "step_4", complete=False)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve_resume(bad, run)


def test_save_load_restores_everything(dist_info, tiny_model_dir, tmp_path):
    run = str(tmp_path / "run")
    tc = TrainerConfig(lr=1e-2, micro_batch_size=2, grad_accum=2, warmup_steps=1, max_steps=6)
    algo = AlgoConfig()
    engine = build_engine(tiny_model_dir, tc)
    train_step(engine, make_turns(0), [1, -1, 1, -1], algo=algo)
    torch.manual_seed(5)
    state = TrainerState(step=engine.global_steps, sampler={"cursor": 7, "epoch": 1}, anneal_step=1,
                         extra={"baseline": [0.5, 0.25]})
    path = save_checkpoint(engine, run, state, tokenizer=tiny_model_dir, keep_last=2)
    assert path.endswith("step_1") and latest_checkpoint(run) == path
    assert sorted(os.listdir(path)) == ["COMPLETE", "deepspeed", "hf", "latest", "rng", "trainer_state.json"]
    saved = params(engine)
    draw = torch.rand(3)
    # Continue: one more update; remember where it leads.
    after = train_step(engine, make_turns(1), [1, -1, 1, -1], algo=algo)
    continued = params(engine)
    assert any(not torch.equal(a, b) for a, b in zip(saved, continued))

    torch.manual_seed(123)
    restored = load_checkpoint(engine, path)
    assert restored == state
    assert engine.global_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(saved, params(engine)))
    assert torch.equal(torch.rand(3), draw)                            # RNG exactly where it was
    # Optimizer moments and LR schedule restored too: the same update lands on the same weights.
    again = train_step(engine, make_turns(1), [1, -1, 1, -1], algo=algo)
    assert again["charts/lr"] == after["charts/lr"]
    assert all(torch.equal(a, b) for a, b in zip(continued, params(engine)))
    assert read_trainer_state(path).sampler == {"cursor": 7, "epoch": 1}

    # keep_last prunes older complete checkpoints.
    for step in (2, 3):
        save_checkpoint(engine, run, TrainerState(step=step), keep_last=2)
    assert [os.path.basename(p) for p in list_checkpoints(run)] == ["step_2", "step_3"]


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_hf_export_loads_with_identical_logits(dist_info, tiny_model_dir, tmp_path, zero_stage):
    """Under ZeRO-3 the export gathers the partitioned weights first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tc = TrainerConfig(lr=1e-2, micro_batch_size=4, grad_accum=1, max_steps=3, zero_stage=zero_stage)
    engine = build_engine(tiny_model_dir, tc)
    train_step(engine, make_turns(2), [1, -1, 1, -1], algo=AlgoConfig())
    out = str(tmp_path / "sync" / "policy")
    os.makedirs(out)
    open(os.path.join(out, "stale.txt"), "w").write("old version")
    assert export_hf(engine, AutoTokenizer.from_pretrained(tiny_model_dir), out) == out
    assert not os.path.exists(os.path.join(out, "stale.txt"))          # replaced as a whole
    assert [n for n in os.listdir(tmp_path / "sync") if n != "policy"] == []   # no temporaries left
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 300, 42, 9, 2]])
    with torch.no_grad():
        want = engine.module(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert torch.equal(want, got)
    assert AutoTokenizer.from_pretrained(out).encode("hello") == AutoTokenizer.from_pretrained(tiny_model_dir).encode("hello")


# ---------------------------------------------------------------------------
# Manifests: a damaged newest checkpoint is passed over for the newest intact one
# ---------------------------------------------------------------------------

# One file of each kind a checkpoint holds; every one of them, cut short, must be caught.
FILE_KINDS = ["trainer_state.json", "deepspeed/mp_rank_00_model_states.pt", "rng/rank_0.json",
              "hf/model.safetensors", "hf/config.json", "latest"]


@pytest.fixture(scope="module")
def two_checkpoints(dist_info, tiny_model_dir, tmp_path_factory):
    """A run directory with real checkpoints at steps 1 and 2 (the files are copied per test)."""
    run = str(tmp_path_factory.mktemp("ckpts") / "run")
    engine = build_engine(tiny_model_dir, TrainerConfig(lr=1e-2, micro_batch_size=4, max_steps=4))
    for step in (1, 2):
        train_step(engine, make_turns(step), [1, -1, 1, -1], algo=AlgoConfig())
        save_checkpoint(engine, run, TrainerState(step=step), tokenizer=tiny_model_dir)
    return run, engine


def _copy_run(src, tmp_path):
    import shutil

    dst = str(tmp_path / "run")
    shutil.copytree(src, dst)
    return dst


def _truncate(path, keep=0.5):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def test_manifest_lists_every_file_with_size_and_sha256(two_checkpoints):
    run, _ = two_checkpoints
    ck = os.path.join(run, "checkpoints", "step_2")
    marker = json.load(open(os.path.join(ck, "COMPLETE")))
    assert marker["step"] == 2 and marker["time"] > 0
    on_disk = sorted(os.path.relpath(os.path.join(d, n), ck) for d, _, ns in os.walk(ck) for n in ns)
    assert sorted(marker["files"]) == [f for f in on_disk if f != "COMPLETE"]
    for kind in FILE_KINDS:
        assert kind in marker["files"], kind
    import hashlib
    meta = marker["files"]["hf/model.safetensors"]
    data = open(os.path.join(ck, "hf/model.safetensors"), "rb").read()
    assert meta == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(ck) is None and verify_checkpoint(ck, check="size") is None


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_truncated_file_of_newest_checkpoint_falls_back_to_the_previous(two_checkpoints, tmp_path, kind):
    run = _copy_run(two_checkpoints[0], tmp_path)
    newest = os.path.join(run, "checkpoints", "step_2")
    _truncate(os.path.join(newest, kind))
    skipped = []
    chosen = resolve_resume("auto", run, check="size", skipped=skipped)
    assert chosen == os.path.join(run, "checkpoints", "step_1")
    assert skipped == [(newest, skipped[0][1])] and skipped[0][1].startswith(f"{kind} has ")
    # The same file, damaged in a checkpoint named explicitly, is an error, not a silent substitute.
    with pytest.raises(CheckpointError, match=f"step_2 is damaged \\({kind} has"):
        resolve_resume(newest, run)
    # The checkpoint chosen instead loads.
    engine = two_checkpoints[1]
    assert load_checkpoint(engine, chosen).step == 1 and engine.global_steps == 1


def test_same_size_corruption_is_caught_by_sha256_only(two_checkpoints, tmp_path):
    run = _copy_run(two_checkpoints[0], tmp_path)
    path = os.path.join(run, "checkpoints", "step_2", "hf", "model.safetensors")
    with open(path, "r+b") as f:       # flip one byte in the middle of the weights
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    ck = os.path.dirname(os.path.dirname(path))
    assert verify_checkpoint(ck, check="size") is None
    assert verify_checkpoint(ck, check="sha256") == "hf/model.safetensors does not match its sha256 in the manifest"
    assert resolve_resume("auto", run, check="sha256").endswith("step_1")


@pytest.mark.parametrize("kind", ["trainer_state.json", "deepspeed/mp_rank_00_model_states.pt", "rng/rank_0.json",
                                  "hf/model.safetensors"])
def test_checkpoint_without_manifest_gets_structural_checks(two_checkpoints, tmp_path, kind):
    """A checkpoint written before manifests: each file kind, cut short, is still recognised."""
    run = _copy_run(two_checkpoints[0], tmp_path)
    ck = os.path.join(run, "checkpoints", "step_2")
    json.dump({"step": 2}, open(os.path.join(ck, "COMPLETE"), "w"))
    assert verify_checkpoint(ck) is None
    _truncate(os.path.join(ck, kind))
    assert verify_checkpoint(ck).startswith(f"{kind} is damaged")


def test_missing_file_and_unreadable_marker(two_checkpoints, tmp_path):
    run = _copy_run(two_checkpoints[0], tmp_path)
    ck = os.path.join(run, "checkpoints", "step_2")
    os.remove(os.path.join(ck, "rng", "rank_0.json"))
    assert verify_checkpoint(ck) == "rng/rank_0.json is missing"
    _truncate(os.path.join(run, "checkpoints", "step_1", "COMPLETE"))
    skipped = []
    assert resolve_resume("auto", run, skipped=skipped) is None      # nothing intact: a fresh start
    assert [p for p, _ in skipped] == [ck, os.path.join(run, "checkpoints", "step_1")]
    assert skipped[1][1].startswith("COMPLETE marker unreadable")
    with pytest.raises(CheckpointError, match="no intact complete checkpoint"):
        resolve_resume(run, "/elsewhere")
