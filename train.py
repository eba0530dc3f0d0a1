"""aflow_rl: train an LLM orchestrator with reinforcement learning.

    python train.py configs/quickstart.yaml [key=value ...]      # one process (CPU or one GPU)
    torchrun --nproc_per_node=8 train.py configs/deep.yaml       # N ranks
    python train.py --help                                       # every config key with its help
    tensorboard --logdir runs/

One iteration (DESIGN.md):
  rank 0: tasks -> RolloutPool (worker processes, episodes against the servers) -> Trajectories
  rank 0: PARL-shaped rewards -> GRPO/GiGPO advantages -> batch, shared with every rank
  all ranks: DeepSpeed PPO update
  rank 0: weight sync to the policy servers, TensorBoard, checkpoints
"""
from __future__ import annotations

import asyncio
import importlib
import json
import math
import os
import sys
import time
from collections import defaultdict

import numpy as np

from aflow_rl.config import Config, ConfigError, format_help, load_config, save_resolved


def parse_args(argv: list[str]) -> Config:
    """``CONFIG.yaml [key=value ...]``; ``--help`` prints every key."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("Config keys (set in the YAML or as key=value):")
        print(format_help())
        sys.exit(0 if argv else 2)
    path, overrides = (argv[0], argv[1:]) if "=" not in argv[0] else (None, argv)
    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        sys.exit(f"config error: {exc}")


def preflight(cfg: Config) -> None:
    """What a recipe needs from the machine, checked before anything slow starts."""
    import importlib.util

    import torch

    if cfg.trainer.require_cuda and not torch.cuda.is_available():
        sys.exit("this recipe trains on GPUs (trainer.require_cuda=true) but CUDA is not available here; "
                 "on a CPU machine run configs/quickstart.yaml")
    for role in ("policy", "actor"):
        if getattr(cfg.serving, role).backend == "sglang" and importlib.util.find_spec("sglang") is None:
            sys.exit(f"serving.{role}.backend=sglang but the sglang package is not installed: "
                     "pip install -e .[gpu] (or use backend=embedded on CPU)")


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    preflight(cfg)
    make_tasks = _task_source(cfg.rollout.worker)
    if _already_done(cfg):
        return

    # Heavy imports after argument parsing, so --help and config errors are instant.
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from aflow_rl.algos.advantages import from_trajectories, valid_group_mask
    from aflow_rl.algos.parl import parl_lambdas, shaped_rewards
    from aflow_rl.llm import make_client
    from aflow_rl.rollout.pool import RolloutPool, make_episodes
    from aflow_rl.rollout.sampler import TaskSampler
    from aflow_rl.rollout.types import WorkerContext
    from aflow_rl.serving.grammar import GrammarBackend
    from aflow_rl.serving.manager import ServerManager
    from aflow_rl.trainer.batch import turn_grammar_masks
    from aflow_rl.trainer.checkpoint import TrainerState, load_checkpoint, resolve_resume, save_checkpoint
    from aflow_rl.trainer.engine import (build_engine, load_reference, setup_distributed, share_from_rank0,
                                         teardown_distributed, train_step)
    from aflow_rl.trainer.logger import TBLogger

    # ---- distributed set-up: plain python is a 1-rank group, torchrun gives N ranks -------------
    dist = setup_distributed()
    main_rank = dist.is_main
    run_dir = cfg.run_dir
    torch.manual_seed(cfg.run.seed + dist.rank)
    np.random.seed(cfg.run.seed + dist.rank)
    servers = pool = logger = None
    try:
        if main_rank:
            os.makedirs(run_dir, exist_ok=True)
            save_resolved(cfg)
            # Rank 0 owns the inference servers (and builds the offline tiny model if asked to).
            servers = ServerManager(cfg.serving, run_dir).start()
        torch.distributed.barrier()  # the policy model directory exists from here on
        policy_path = cfg.serving.policy.model_path
        tokenizer = AutoTokenizer.from_pretrained(policy_path)

        # ---- the DeepSpeed engine (every rank), the reference model, resume ----------------------
        engine = build_engine(policy_path, cfg.trainer)
        ref_model = load_reference(policy_path, engine) if cfg.algo.kl_coef > 0 else None
        state = TrainerState()
        resume_from = resolve_resume(cfg.resume, run_dir)
        if resume_from:
            state = load_checkpoint(engine, resume_from)  # weights, optimizer, schedule, this rank's RNG
            if main_rank:
                print(f"resumed from {resume_from} at step {state.step}", flush=True)

        # ---- rank 0: the environment's task source, the worker pool, the weight-sync client ------
        sampler = TaskSampler(make_tasks, cfg, cfg.run.seed, num_tasks=cfg.rollout.num_tasks)
        if state.sampler:
            sampler.load_state_dict(state.sampler)
        grammar = GrammarBackend.from_pretrained(policy_path) if main_rank else None
        if main_rank:
            logger = TBLogger(run_dir)
            logger.hparams(_hparams(cfg))
            urls = servers.all_urls()
            pool = RolloutPool(cfg.rollout, WorkerContext(config=cfg, urls=urls, run_dir=run_dir)).start()
            policy_admin = make_client(cfg.llm.policy, urls.get("policy", []), role="policy")
        if state.step > 0:
            # The servers started from the base model: bring them to the resumed weights.
            _sync(engine, tokenizer, policy_admin if main_rank else None, run_dir, state.step, cfg)

        # ---- the loop ----------------------------------------------------------------------------
        bar = tqdm(total=cfg.trainer.max_steps, initial=state.step, disable=not main_rank,
                   desc=cfg.run.name, dynamic_ncols=True)
        for step in range(state.step, cfg.trainer.max_steps):
            t_start = time.perf_counter()
            batch = None
            if main_rank:
                # 1. Rollout: B tasks x G episodes, streamed back from the worker processes.
                tasks = sampler.next(cfg.rollout.tasks_per_step)
                episodes = make_episodes(tasks, cfg.rollout.group_size, prefix=f"s{step}-")
                trajs = list(pool.run(episodes))
                t_rollout = time.perf_counter() - t_start
                _save_episodes(run_dir, step, trajs)

                # 2. Rewards: PARL shaping (annealed lambdas) -> the episode return R_i.
                #    The terminal reward is R_i minus the step rewards the env already placed
                #    on turns, so every estimator sees exactly the shaped return.
                shaped = shaped_rewards(trajs, step, cfg.algo.parl)
                keep = valid_group_mask([t.group_id for t in trajs], [t.ok and bool(t.turns) for t in trajs])
                kept = [t for t, k in zip(trajs, keep) if k]
                terminal = [s - float(t.step_rewards.sum()) for t, s, k in zip(trajs, shaped, keep) if k]

                # 3. Advantages: GRPO over episode groups, or GiGPO (+ anchor-state step groups).
                advs = from_trajectories(cfg.algo, kept, terminal)
                turns = [turn for t in kept for turn in t.turns]
                flat_adv = np.concatenate(advs) if advs else np.zeros(0)
                masks = turn_grammar_masks(turns, grammar)
                batch = (turns, flat_adv, masks)
                roll_stats = _rollout_stats(trajs, shaped, keep, pool.stats, parl_lambdas(step, cfg.algo.parl))
                roll_stats["timing/rollout_s"] = t_rollout

            # 4. Every rank trains on rank 0's batch; the whole batch is one optimizer step
            #    per PPO epoch (the accumulation follows the batch), so the x-axis of every
            #    curve and the LR schedule count the same steps.
            turns, flat_adv, masks = share_from_rank0(batch)
            t_train = time.perf_counter()
            if turns:
                per_step = engine.train_micro_batch_size_per_gpu() * dist.world_size
                engine.set_train_batch_size(per_step * math.ceil(len(turns) / per_step))
                train_stats = train_step(engine, turns, flat_adv, algo=cfg.algo, ppo_epochs=cfg.trainer.ppo_epochs,
                                         temperature=cfg.env.temperature, ref_model=ref_model,
                                         grammar_masks=masks, pad_id=tokenizer.pad_token_id or 0)
            else:
                train_stats = {}  # every group failed or was too small: nothing to learn from this step
            train_s = time.perf_counter() - t_train

            # 5. Weight sync: the servers sample the next rollout from the new weights.
            sync_s = 0.0
            if (step + 1) % cfg.trainer.sync_every == 0 and turns:
                sync_s = _sync(engine, tokenizer, policy_admin if main_rank else None, run_dir, step + 1, cfg)

            # 6. Logging (rank 0) and checkpoints (every rank: ZeRO shards are per rank).
            state.step, state.sampler, state.anneal_step = step + 1, sampler.state_dict(), step + 1
            if main_rank:
                stats = {**roll_stats, **train_stats, "timing/train_s": train_s, "timing/sync_s": sync_s,
                         "timing/step_s": time.perf_counter() - t_start}
                if step % cfg.trainer.log_every == 0 or step + 1 == cfg.trainer.max_steps:
                    logger.scalars(stats, step + 1)
                    if len(flat_adv):
                        logger.histogram("rewards/advantages", flat_adv, step + 1)
                if step % cfg.trainer.sample_every == 0:
                    logger.text("samples/episode", _sample_text(trajs, tokenizer), step + 1)
                bar.set_postfix(reward=f"{stats.get('rewards/mean', float('nan')):.3f}",
                                loss=f"{stats.get('losses/policy', float('nan')):.3f}",
                                roll=f"{stats['timing/rollout_s']:.1f}s", train=f"{train_s:.1f}s")
            bar.update(1)
            last = step + 1 == cfg.trainer.max_steps
            if (step + 1) % cfg.trainer.save_every == 0 or last:
                save_checkpoint(engine, run_dir, state, tokenizer=tokenizer, keep_last=cfg.trainer.keep_last)
        bar.close()
        if main_rank:
            print(f"done: {state.step} steps; events, checkpoints and traces in {run_dir}")
    finally:
        if pool is not None:
            pool.close()
        if logger is not None:
            logger.close()
        if servers is not None:
            servers.stop()
        teardown_distributed()


# ---------------------------------------------------------------------------------------------
# Small pieces of the loop, kept out of main() so that main() reads as the iteration.
# ---------------------------------------------------------------------------------------------


def _already_done(cfg: Config) -> bool:
    """True (and says so) when resume finds a checkpoint at trainer.max_steps: nothing to start."""
    from aflow_rl.trainer.checkpoint import read_trainer_state, resolve_resume

    path = resolve_resume(cfg.resume, cfg.run_dir)
    if path is None or read_trainer_state(path).step < cfg.trainer.max_steps:
        return False
    print(f"{cfg.run_dir} is complete ({path}, trainer.max_steps={cfg.trainer.max_steps}); to train further "
          "raise trainer.max_steps, or start over with resume=never or another run.dir")
    return True


def _task_source(worker: str):
    """The worker module's ``make_tasks(cfg, n, seed)``: the environment that runs the
    episodes also says what its tasks are."""
    module_name = worker.split(":")[0]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"rollout.worker: cannot import {module_name} ({exc}); worker modules must be "
                          f"installed or on sys.path (pip install -e .)") from None
    if not callable(getattr(module, "make_tasks", None)):
        raise ConfigError(f"rollout.worker: {module_name} has no make_tasks(cfg, n, seed) function to "
                          "draw training tasks from")
    return module.make_tasks


def _sync(engine, tokenizer, client, run_dir, version, cfg) -> float:
    """Export the weights, compute the probe logprobs (both collective under ZeRO-3, so every
    rank calls this), then rank 0 (``client`` not None) pushes them and verifies the servers."""
    import torch

    from aflow_rl.serving.weight_sync import sync_weights
    from aflow_rl.trainer.weights import export_hf

    t0 = time.perf_counter()
    model_dir = export_hf(engine, tokenizer, os.path.join(run_dir, "sync", "policy"))
    # Probe: the trainer's own logprobs of a fixed prompt; the servers must reproduce them.
    probe_ids = tokenizer.encode('{"action": "finish", "answer": "probe"}', add_special_tokens=False)[:16]
    with torch.no_grad():
        ids = torch.tensor([probe_ids], device=engine.device)
        logits = engine.module(input_ids=ids).logits.float()[0, :-1]
        expected = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu().numpy()
    if client is None or not client.urls:
        return time.perf_counter() - t0
    tol = 1e-2 if cfg.trainer.precision == "fp32" else 0.1
    asyncio.run(sync_weights(client, model_dir, version, probe_ids=probe_ids, expected_logprobs=expected,
                             tol=tol, timeout_s=cfg.trainer.sync_timeout_s))
    return time.perf_counter() - t0


def _rollout_stats(trajs, shaped, keep, pool_stats, lambdas) -> dict:
    """Scalars of one rollout under DESIGN.md's tags."""
    ok = [i for i, t in enumerate(trajs) if t.ok]
    stats: dict[str, float] = {
        "pool/failed": float(sum(not t.ok for t in trajs)),
        "pool/retries": float(pool_stats.get("retries", 0)),
        "pool/skipped_episodes": float(len(trajs) - int(np.sum(keep))),
        "charts/parl_lambda1": lambdas[0], "charts/parl_lambda2": lambdas[1],
    }
    if ok:
        r = np.asarray([shaped[i] for i in ok])
        stats["rewards/mean"], stats["rewards/std"] = float(r.mean()), float(r.std(ddof=1)) if len(r) > 1 else 0.0
        comps, metrics = defaultdict(list), defaultdict(list)
        for i in ok:
            for k, v in trajs[i].reward_components.items():
                comps[k].append(float(v))
            for k, v in trajs[i].metrics.items():
                if isinstance(v, (int, float)):
                    metrics[k].append(float(v))
        stats.update({f"rewards/{k}/mean": float(np.mean(v)) for k, v in comps.items()})
        stats.update({f"episode/{k}": float(np.mean(v)) for k, v in metrics.items()})
    return stats


def _save_episodes(run_dir: str, step: int, trajs) -> None:
    """Every completed episode of the step, as JSONL (nothing a crash later can lose)."""
    path = os.path.join(run_dir, "episodes", f"step_{step:06d}.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        for t in trajs:
            fh.write(json.dumps(t.to_dict(), default=str) + "\n")


def _sample_text(trajs, tokenizer, n: int = 2) -> str:
    """A few episodes, decoded turn by turn, for TensorBoard's text tab."""
    parts = []
    for t in [t for t in trajs if t.ok][:n]:
        lines = [f"episode {t.episode_id} reward {t.final_reward:.3f} components {t.reward_components}"]
        for k, turn in enumerate(t.turns):
            lines.append(f"turn {k}: {tokenizer.decode(turn.response_ids)}")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) or "(no successful episode this step)"


def _hparams(cfg: Config) -> dict:
    return {"lr": cfg.trainer.lr, "group_size": cfg.rollout.group_size, "tasks_per_step": cfg.rollout.tasks_per_step,
            "adv_estimator": cfg.algo.adv_estimator, "clip_low": cfg.algo.clip_low, "clip_high": cfg.algo.clip_high,
            "kl_coef": cfg.algo.kl_coef, "temperature": cfg.env.temperature}


def cli() -> None:
    """``main`` with the failures a user can fix reported as one line, not a traceback
    (set AFLOW_RL_TRACEBACK=1 to see it anyway)."""
    from aflow_rl.llm.base import LLMError
    from aflow_rl.rollout.pool import PoolError
    from aflow_rl.serving.manager import ServerError
    from aflow_rl.serving.weight_sync import WeightSyncError

    try:
        main()
    except (ConfigError, ServerError, PoolError, WeightSyncError, LLMError) as exc:
        if os.environ.get("AFLOW_RL_TRACEBACK"):
            raise
        sys.exit(f"config error: {exc}" if isinstance(exc, ConfigError) else f"error: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    cli()
