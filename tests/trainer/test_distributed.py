"""torchrun --nproc_per_node=2 on CPU (gloo) computes the same loss and update as one
rank with twice the gradient accumulation; a 2-rank checkpoint is complete."""
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)


@pytest.mark.slow
def test_two_ranks_match_one_rank_with_double_accumulation(dist_info, tiny_model_dir, tmp_path):
    from dist_equivalence import fixed_batch

    from transformers import AutoModelForCausalLM

    from aflow_rl.config import AlgoConfig, TrainerConfig
    from aflow_rl.trainer.checkpoint import latest_checkpoint
    from aflow_rl.trainer.learner import build_engine, train_step

    out = str(tmp_path / "two_ranks.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)      # this test process's own 1-rank group must not leak into torchrun
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(HERE, "dist_equivalence.py"), tiny_model_dir, out, "2"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = torch.load(out)
    assert two["world_size"] == 2
    ckpt = latest_checkpoint(str(tmp_path / "run"))
    assert ckpt and ckpt.endswith("step_1")
    assert sorted(os.listdir(os.path.join(ckpt, "rng"))) == ["rank_0.json", "rank_1.json"]
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(ckpt, "hf"), dtype=torch.float32)
    for name, p in exported.named_parameters():
        assert torch.equal(p.detach(), two["params"][name]), name

    # The same batch on this process's single rank: 8 turns, micro-batch 2, accumulation 4.
    torch.manual_seed(0)
    engine = build_engine(tiny_model_dir, TrainerConfig(lr=1e-3, micro_batch_size=2, grad_accum=4, max_steps=10))
    turns, adv = fixed_batch()
    one = train_step(engine, turns, adv, algo=AlgoConfig(kl_coef=0.0, entropy_coef=0.01))
    for tag in ("losses/total", "losses/policy", "losses/entropy", "losses/grad_norm", "perf/logprob_mismatch"):
        assert two["stats"][tag] == pytest.approx(one[tag], rel=1e-5), tag
    assert two["stats"]["charts/optimizer_steps"] == one["charts/optimizer_steps"] == 1.0
    # Adam's first update is lr * g / (|g| + eps): it turns the float-summation-order
    # differences of tiny gradients into visible ones, so the bound is 1% of the lr.
    for name, p in engine.module.named_parameters():
        assert torch.allclose(two["params"][name], p.detach(), atol=1e-5, rtol=0), name
