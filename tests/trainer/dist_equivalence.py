"""One PPO train step on a fixed batch; rank 0 saves the stats and the updated weights,
then all ranks write a checkpoint next to OUT.pt.

    torchrun --standalone --nproc_per_node=2 tests/trainer/dist_equivalence.py MODEL_DIR OUT.pt 2
    python tests/trainer/dist_equivalence.py MODEL_DIR OUT.pt 4

Run by tests/trainer/test_distributed.py: N ranks with accumulation k must match
one rank with accumulation N*k (the same loss and the same update).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from aflow_rl.config import AlgoConfig, TrainerConfig  # noqa: E402
from aflow_rl.rollout.types import Turn  # noqa: E402
from aflow_rl.trainer.checkpoint import TrainerState, save_checkpoint  # noqa: E402
from aflow_rl.trainer.learner import (build_engine, setup_distributed, share_from_rank0,  # noqa: E402
                                    teardown_distributed, train_step)


def fixed_batch():
    """Eight turns of different lengths and their advantages, the same in every process."""
    rng = np.random.default_rng(0)
    turns = [Turn(prompt_ids=rng.integers(3, 1000, 3 + i % 4), response_ids=rng.integers(3, 1000, 2 + i % 3),
                  logprobs=-rng.random(2 + i % 3) * 7) for i in range(8)]
    return turns, rng.standard_normal(8)


def main(model_dir: str, out: str, grad_accum: int) -> None:
    dist = setup_distributed()
    torch.manual_seed(0)
    tc = TrainerConfig(lr=1e-3, micro_batch_size=2, grad_accum=grad_accum, max_steps=10)
    engine = build_engine(model_dir, tc)
    # Only rank 0 "ran the rollout"; the others receive its batch.
    turns, adv = share_from_rank0(fixed_batch() if dist.rank == 0 else None)
    stats = train_step(engine, turns, adv, algo=AlgoConfig(kl_coef=0.0, entropy_coef=0.01))
    if dist.rank == 0:
        torch.save({"stats": stats, "world_size": dist.world_size,
                    "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}, out)
    save_checkpoint(engine, os.path.join(os.path.dirname(out), "run"), TrainerState(step=engine.global_steps),
                    tokenizer=model_dir)
    teardown_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
