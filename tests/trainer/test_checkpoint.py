"""Checkpoints: exact restore of weights, optimizer, schedule, RNG and trainer state;
completeness, pruning, resume resolution; the Hugging Face export."""
import json
import os
import random

import numpy as np
import pytest
import torch

from aflow_rl.config import AlgoConfig, TrainerConfig
from aflow_rl.rollout.types import Turn
from aflow_rl.trainer.checkpoint import (TrainerState, capture_rng, latest_checkpoint, list_checkpoints,
                                         load_checkpoint, prune_checkpoints, read_trainer_state,
                                         resolve_resume, restore_rng, save_checkpoint)
from aflow_rl.trainer.engine import build_engine, train_step
from aflow_rl.trainer.weights import export_hf


def make_turns(seed):
    rng = np.random.default_rng(seed)
    return [Turn(prompt_ids=rng.integers(3, 1000, 5), response_ids=rng.integers(3, 1000, 3),
                 logprobs=np.full(3, -6.9)) for _ in range(4)]


def params(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


def fake_checkpoint(run_dir, name, complete=True):
    path = os.path.join(run_dir, "checkpoints", name)
    os.makedirs(path)
    if complete:
        open(os.path.join(path, "COMPLETE"), "w").write("{}")
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
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        resolve_resume(str(tmp_path / "nope"), run)
    bad = fake_checkpoint(run, "step_4", complete=False)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
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
