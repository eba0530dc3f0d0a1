"""aflow_rl: train an LLM orchestrator with reinforcement learning.

    python train.py configs/quickstart.yaml [key=value ...]      # one process (CPU or one GPU)
    torchrun --nproc_per_node=8 train.py configs/deep.yaml       # N ranks
    python train.py --help                                       # every config key with its help
    tensorboard --logdir runs/

One iteration (main(); docs/architecture.md walks it through the code):
  rank 0: tasks -> RolloutPool (worker processes, episodes against the servers) -> Trajectories
  rank 0: build_batch: PARL-shaped rewards -> GRPO/GiGPO advantages -> Batch, shared with every rank
  all ranks: Learner.train (DeepSpeed PPO update), Learner.sync (weights to the policy servers)
  rank 0: Rank0Services.log (TensorBoard, progress bar); all ranks: Learner.save (checkpoints)
"""
from __future__ import annotations

import os

# Before anything can load torch: spinning OpenMP threads made a training step on a loaded
# 2-core machine 10.8x slower (issue 13); a value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import asyncio  # noqa: E402 - after the OpenMP setting above
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

import numpy as np  # noqa: E402

from aflow_rl.config import Config, ConfigError, format_help, load_config, save_resolved  # noqa: E402
from aflow_rl.envs import load_env  # noqa: E402


def parse_args(argv: list[str]) -> Config:
    """``CONFIG.yaml [key=value ...]``; ``--help`` prints every key."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("Config keys (set in the YAML or as key=value):")
        print(format_help())
        sys.exit(0 if argv else 2)
    try:
        return load_config(*_split_args(argv))
    except ConfigError as exc:
        sys.exit(f"config error: {exc}")


def _split_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG.yaml] key=value ...`` -> (config path or None, overrides)."""
    return (argv[0], argv[1:]) if argv and "=" not in argv[0] else (None, argv)


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
    from aflow_rl.sandbox import configure

    # AFlow runs generated code: say which isolation it gets (SandboxRefused, a ConfigError, where only
    # basic isolation exists and sandbox.allow_unisolated is false). Other envs only pass the setting on.
    line = configure(cfg.sandbox.allow_unisolated, check=cfg.env.name == "aflow")
    if line:
        print(line, flush=True)


class RunFailed(RuntimeError):
    """The run cannot learn: every episode of a step failed, in every retry of its rollout."""


def main(argv: list[str] | None = None) -> None:
    """Set up, then per step: rollout -> batch (rank 0, shared) -> train -> sync -> log -> checkpoint."""
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    preflight(cfg)
    make_tasks = load_env(cfg.env.name).make_tasks
    if _already_done(cfg):
        return
    # Heavy imports after argument parsing, so --help and config errors are instant.
    import torch

    from aflow_rl.trainer.console import quiet_libraries

    quiet_libraries(torch.cuda.is_available())   # before DeepSpeed and transformers print anything
    from aflow_rl.trainer.learner import setup_distributed, teardown_distributed

    dist = setup_distributed()   # plain python: a 1-rank group; torchrun: N ranks
    torch.manual_seed(cfg.run.seed + dist.rank)
    np.random.seed(cfg.run.seed + dist.rank)
    # on_rank0(fn, *args): rank 0 runs it; an error there is raised on every rank (none waits in a collective).
    on_rank0 = functools.partial(_from_rank0, dist.is_main)
    rank0 = Rank0Services(cfg)
    try:
        on_rank0(rank0.start_servers, share=False)
        learner, state = Learner.build(cfg, dist)
        on_rank0(rank0.start_rollout, make_tasks, state, learner.tokenizer, share=False)
        if state.step > 0:   # the servers started from the base model: bring them to the resumed weights
            learner.sync(rank0.policy_admin, state.step)
        for step in range(state.step, cfg.trainer.max_steps):
            t_start = time.perf_counter()
            batch = on_rank0(rank0.rollout, step)     # rollout -> rewards, advantages: every rank gets it
            stats = learner.train(batch)
            due = (step + 1) % cfg.trainer.sync_every == 0 and batch.turns
            stats["timing/sync_s"] = learner.sync(rank0.policy_admin, step + 1) if due else 0.0
            state.step, state.anneal_step, state.sampler = step + 1, step + 1, rank0.sampler_state(step + 1)
            on_rank0(rank0.publish, step + 1, share=False)   # async mode: admits the next chunk
            stats["timing/step_s"] = time.perf_counter() - t_start
            on_rank0(rank0.log, step, batch, stats, share=False)
            if (step + 1) % cfg.trainer.save_every == 0 or step + 1 == cfg.trainer.max_steps:
                learner.save(state)   # every rank: ZeRO shards are per rank
        rank0.finish(state.step)
    finally:
        rank0.close()
        teardown_distributed()


class Learner:
    """Every rank's half of the run: the DeepSpeed engine, the frozen reference (KL only), the
    tokenizer. Each method is collective: every rank calls it with the same arguments."""

    def __init__(self, cfg: Config, dist, engine, ref_model, tokenizer):
        self.cfg, self.dist, self.engine, self.ref_model, self.tokenizer = cfg, dist, engine, ref_model, tokenizer
        self.dist_sync = None   # trainer.sync=distributed: the update group, joined at the first sync

    @classmethod
    def build(cls, cfg: Config, dist):
        """(Learner, TrainerState): the engine from the policy model directory, resumed from the
        checkpoint rank 0 picks (damaged ones set aside, the run's records rewound to it)."""
        from transformers import AutoTokenizer

        from aflow_rl.trainer.checkpoint import TrainerState, load_checkpoint
        from aflow_rl.trainer.learner import build_engine, load_reference

        policy_path = cfg.serving.policy.model_path   # exists: rank 0 started the servers first
        tokenizer = AutoTokenizer.from_pretrained(policy_path)
        engine = build_engine(policy_path, cfg.trainer)
        ref_model = load_reference(policy_path, engine) if cfg.algo.kl_coef > 0 else None
        resume_from = _from_rank0(dist.is_main, _choose_start, cfg)
        state = load_checkpoint(engine, resume_from) if resume_from else TrainerState()
        return cls(cfg, dist, engine, ref_model, tokenizer), state

    def train(self, batch) -> dict:
        """PPO on rank 0's batch; the whole batch is one optimizer step per PPO epoch (the
        accumulation follows the batch), so every curve and the LR schedule count the same steps."""
        from aflow_rl.trainer.learner import train_step

        t_train = time.perf_counter()
        if not batch.turns:
            return {"timing/train_s": time.perf_counter() - t_train}   # every group failed or was too small
        engine, cfg = self.engine, self.cfg
        per_step = engine.train_micro_batch_size_per_gpu() * self.dist.world_size
        engine.set_train_batch_size(per_step * math.ceil(len(batch.turns) / per_step))
        stats = train_step(engine, batch.turns, batch.advantages, algo=cfg.algo, ppo_epochs=cfg.trainer.ppo_epochs,
                           temperature=cfg.env.temperature, ref_model=self.ref_model,
                           grammar_masks=batch.grammar_masks, pad_id=self.tokenizer.pad_token_id or 0)
        return {**stats, "timing/train_s": time.perf_counter() - t_train}

    def sync(self, client, version: int) -> float:
        """Export the weights and compute the probe logprobs (both collective under ZeRO-3), then
        rank 0 (``client`` not None) pushes them and verifies the servers. Returns seconds."""
        import torch

        from aflow_rl.serving.weight_sync import sync_weights, verify_servers
        from aflow_rl.trainer.weights import export_hf

        t0 = time.perf_counter()
        engine, tokenizer, cfg = self.engine, self.tokenizer, self.cfg
        distributed = cfg.trainer.sync == "distributed"
        if distributed:   # collective: every rank gathers the ZeRO-3 buckets, rank 0 broadcasts them
            from aflow_rl.trainer.dist_sync import DistributedSync

            if self.dist_sync is None:
                self.dist_sync = DistributedSync.from_config(cfg.trainer, cfg.serving.policy.backend)
            self.dist_sync.push(engine, client if client is not None and client.urls else None, version)
        else:
            model_dir = export_hf(engine, tokenizer, os.path.join(cfg.run_dir, "sync", "policy"))
        # Probe: the trainer's own logprobs of a fixed prompt; the servers must reproduce them.
        probe_ids = tokenizer.encode('{"action": "finish", "answer": "probe"}', add_special_tokens=False)[:16]
        with torch.no_grad():
            ids = torch.tensor([probe_ids], device=engine.device)
            logits = engine.module(input_ids=ids).logits.float()[0, :-1]
            expected = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu().numpy()
        if client is None or not client.urls:
            return time.perf_counter() - t0
        tol = 1e-2 if cfg.trainer.precision == "fp32" else 0.1
        if distributed:
            asyncio.run(verify_servers(client, version, probe_ids=probe_ids, expected_logprobs=expected, tol=tol,
                                       timeout_s=cfg.trainer.sync_timeout_s))
        else:
            asyncio.run(sync_weights(client, model_dir, version, probe_ids=probe_ids, expected_logprobs=expected,
                                     tol=tol, timeout_s=cfg.trainer.sync_timeout_s,
                                     inflight=cfg.trainer.sync_inflight, pause_mode=cfg.trainer.sync_pause_mode))
        return time.perf_counter() - t0

    def save(self, state) -> None:
        from aflow_rl.trainer.checkpoint import save_checkpoint

        t = self.cfg.trainer
        save_checkpoint(self.engine, self.cfg.run_dir, state, tokenizer=self.tokenizer, keep_last=t.keep_last,
                        check=t.checkpoint_check)


class Rank0Services:
    """What only rank 0 runs: the inference servers, the task sampler, the rollout pool, the
    weight-sync client, the grammar backend, TensorBoard and the progress bar. main() calls the
    start/rollout/log methods through ``_from_rank0`` (rank 0 only, its errors raised on every
    rank); on other ranks every field stays None and the None-safe methods do nothing."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.servers = self.sampler = self.pool = self.policy_admin = self.grammar = None
        self.logger = self.bar = self.tokenizer = self.stream = None
        self._trajs: list = []   # the last rollout's episodes, for the text samples
        self._start_position = self._start_step = 0   # the sampler where this process began
        self._train_from = 0.0   # perf_counter when the last batch went to the trainer (timing/overlap)

    def start_servers(self) -> None:
        """The run directory, the resolved config, and the inference servers (which build the
        offline tiny model if the recipe asks for it: every rank loads it next)."""
        from aflow_rl.serving.manager import ServerManager

        os.makedirs(self.cfg.run_dir, exist_ok=True)
        save_resolved(self.cfg)
        self.servers = ServerManager(self.cfg.serving, self.cfg.run_dir).start()

    def start_rollout(self, make_tasks, state, tokenizer) -> None:
        """The task sampler (at its resumed position), TensorBoard, the worker pool, the weight-sync
        client, the grammar backend and the progress bar."""
        from tqdm import tqdm

        from aflow_rl.llm import make_client
        from aflow_rl.rollout.pool import RolloutPool
        from aflow_rl.rollout.sampler import TaskSampler
        from aflow_rl.rollout.types import WorkerContext
        from aflow_rl.serving.grammar import GrammarBackend
        from aflow_rl.trainer.logger import TBLogger

        cfg, run_dir = self.cfg, self.cfg.run_dir
        self.sampler = TaskSampler(make_tasks, cfg, cfg.run.seed, num_tasks=cfg.rollout.num_tasks)
        if state.sampler:
            self.sampler.load_state_dict(state.sampler)
        self.logger = TBLogger(run_dir, purge_step=state.step + 1)
        self.logger.hparams(_hparams(cfg))
        urls = self.servers.all_urls()
        self.pool = RolloutPool(cfg.rollout, WorkerContext(config=cfg, urls=urls, run_dir=run_dir)).start()
        self.policy_admin = make_client(cfg.llm.policy, urls.get("policy", []), role="policy")
        self.grammar = GrammarBackend.from_pretrained(cfg.serving.policy.model_path)
        self.tokenizer = tokenizer
        self.bar = tqdm(total=cfg.trainer.max_steps, initial=state.step, desc=cfg.run.name, dynamic_ncols=True)
        self._start_position, self._start_step = self.sampler.position, state.step
        if cfg.trainer.max_staleness > 0:
            from aflow_rl.trainer.async_rollout import AsyncRollout

            self.stream = AsyncRollout(self.produce, max_staleness=cfg.trainer.max_staleness, start_step=state.step,
                                       max_steps=cfg.trainer.max_steps, size=lambda item: len(item[1]),
                                       clock=time.perf_counter)

    def rollout(self, step: int):
        """Step ``step``'s Batch. Synchronous (``trainer.max_staleness=0``): B tasks x G episodes
        through the pool now (retried while every episode fails, see :func:`rollout_with_retries`),
        saved, then :func:`build_batch`. Asynchronous: the chunk the rollout thread produced
        (:mod:`aflow_rl.trainer.async_rollout`), waiting for it if needed."""
        from aflow_rl.trainer.async_rollout import staleness_stats
        from aflow_rl.trainer.batch import build_batch

        cfg = self.cfg
        if self.stream is not None:
            # Started at the first step, not in start_rollout: a resumed run syncs the servers to its
            # checkpoint's weights in between, and no episode may be sampled from the base model.
            (batch, trajs), info = self.stream.start().take(step)
            waits = {"async/admission_wait_s": info["admission_wait_s"], "async/queue_episodes": info["queue_episodes"]}
        else:
            t_start = time.perf_counter()
            tasks = self.sampler.next(cfg.rollout.tasks_per_step)
            trajs, pool_stats = rollout_with_retries(
                self.pool, tasks, cfg, step, servers=self.servers, say=self.bar.write,
                save=lambda trajs, again: _save_episodes(cfg.run_dir, step, trajs, append=again))
            t_rollout = time.perf_counter() - t_start
            batch = build_batch(trajs, step, cfg, self.grammar)
            batch.stats = {**_pool_tags(pool_stats), **batch.stats, "timing/rollout_s": t_rollout}
            waits = {"async/admission_wait_s": 0.0, "async/queue_episodes": 0.0}
        batch.stats.update({**waits, **staleness_stats(batch.turns, step)})
        self._trajs, self._train_from = trajs, time.perf_counter()
        return batch

    def produce(self, step: int):
        """The rollout thread's work for step ``step`` (asynchronous mode): draw its tasks, run the
        episodes not already on disk from before a kill (each appended to the step's episode file
        as it completes), build the Batch. Returns (Batch, trajectories)."""
        from aflow_rl.trainer.batch import build_batch
        from aflow_rl.trainer.episode_files import EpisodeAppender, ResumingPool, load_completed

        cfg = self.cfg
        t_start = time.perf_counter()
        tasks = self.sampler.next(cfg.rollout.tasks_per_step)   # only this thread draws in async mode
        done = load_completed(cfg.run_dir, step)
        if done:
            self.bar.write(f"step {step + 1}: {len(done)} completed episode(s) on disk from before the restart "
                           "are reused, not run again")
        pool = ResumingPool(self.pool, done, EpisodeAppender(cfg.run_dir, step))
        trajs, pool_stats = rollout_with_retries(pool, tasks, cfg, step, servers=self.servers, say=self.bar.write)
        t_rollout = time.perf_counter() - t_start
        batch = build_batch(trajs, step, cfg, self.grammar)
        batch.stats = {**_pool_tags(pool_stats), **batch.stats, "timing/rollout_s": t_rollout}
        return batch, trajs

    def publish(self, version: int) -> None:
        """Optimizer step ``version - 1`` is trained (and synced when due): async admission moves on."""
        if self.stream is not None:
            self.stream.publish(version)

    def sampler_state(self, step: int | None = None):
        """The sampler as it stood before drawing step ``step``'s tasks (what a run resumed at
        ``step`` must draw next). Asynchronous mode has drawn ahead, so it is computed: every
        step draws ``tasks_per_step`` tasks (retries reuse them)."""
        if self.sampler is None:
            return None
        if self.stream is None or step is None:
            return self.sampler.state_dict()
        position = self._start_position + (step - self._start_step) * self.cfg.rollout.tasks_per_step
        return {**self.sampler.state_dict(), "position": position}

    def log(self, step: int, batch, train_stats: dict) -> None:
        """TensorBoard scalars (every ``log_every`` steps and the last), the advantage histogram,
        sample episodes (every ``sample_every``), and the progress bar."""
        cfg, logger = self.cfg, self.logger
        stats = {**batch.stats, **train_stats}
        # timing/overlap: the share of the step in which the rollout thread ran while training did.
        trained = self.stream.overlap_s(self._train_from, self._train_from + train_stats["timing/train_s"]) \
            if self.stream is not None else 0.0
        stats["timing/overlap"] = trained / stats["timing/step_s"] if stats.get("timing/step_s") else 0.0
        if step % cfg.trainer.log_every == 0 or step + 1 == cfg.trainer.max_steps:
            logger.scalars(stats, step + 1)
            if len(batch.advantages):
                logger.histogram("rewards/advantages", batch.advantages, step + 1)
        if step % cfg.trainer.sample_every == 0:
            logger.text("samples/episode", _sample_text(self._trajs, self.tokenizer), step + 1)
        self.bar.set_postfix(reward=f"{stats.get('rewards/mean', float('nan')):.3f}",
                             loss=f"{stats.get('losses/policy', float('nan')):.3f}",
                             roll=f"{stats['timing/rollout_s']:.1f}s", train=f"{stats['timing/train_s']:.1f}s")
        self.bar.update(1)

    def finish(self, steps: int) -> None:
        if self.bar is not None:
            self.bar.close()   # the line below starts on a line of its own
            print(f"done: {steps} steps; events, checkpoints and traces in {self.cfg.run_dir}")

    def close(self) -> None:
        """Close the bar first (a message after it starts on its own line), then the pool, logger, servers."""
        parts = ((self.stream, "close"), (self.bar, "close"), (self.pool, "close"), (self.logger, "close"),
                 (self.servers, "stop"))
        for part, stop in parts:
            if part is not None:
                getattr(part, stop)()


def _from_rank0(main_rank: bool, fn, *args, share: bool = True):
    """``fn(*args)`` on rank 0; its exception is raised on every rank (an error found on rank 0 must not
    leave the others waiting in a collective). ``share``: the result goes to every rank too
    (otherwise the other ranks get None and rank 0 keeps its own)."""
    import pickle

    from aflow_rl.trainer.learner import share_from_rank0

    value = error = None
    if main_rank:
        try:
            value = fn(*args)
        except Exception as exc:   # noqa: BLE001 - re-raised below, on every rank
            error = exc
            try:
                pickle.dumps(exc)
            except Exception:      # noqa: BLE001 - the other ranks still need to hear of it
                error = RuntimeError(f"{type(exc).__name__}: {exc}")
                error.__cause__ = exc
    shared, error = share_from_rank0((value if share else None, error))
    if error is not None:
        raise error
    return shared if share else value


def _choose_start(cfg: Config) -> str | None:
    """Rank 0: the checkpoint this run resumes from, after setting aside damaged ones, and the
    run's TensorBoard records, traces and episode files rewound to it. Says which it did."""
    from aflow_rl.trainer.checkpoint import (CHECKPOINTS, list_checkpoints, read_trainer_state, resolve_resume,
                                             saved_at, set_aside)
    from aflow_rl.trainer.records import rewind

    skipped: list[tuple[str, str]] = []
    path = resolve_resume(cfg.resume, cfg.run_dir, check=cfg.trainer.checkpoint_check, skipped=skipped)
    own = os.path.abspath(os.path.join(cfg.run_dir, CHECKPOINTS))
    for bad, problem in skipped:
        if os.path.dirname(os.path.abspath(bad)) == own:
            print(f"checkpoint {bad} is damaged ({problem}); set aside as {set_aside(bad)}", flush=True)
        else:
            print(f"checkpoint {bad} is damaged ({problem}); passed over", flush=True)
    if cfg.resume == "never":   # starting over: an earlier checkpoint must not be resumed from later
        for old in list_checkpoints(cfg.run_dir):
            print(f"resume=never: set aside the earlier checkpoint {old} as {set_aside(old, 'superseded')}",
                  flush=True)
    step = read_trainer_state(path).step if path else 0
    # Async mode keeps the episode files of untrained steps: the resumed rollout reuses them.
    rewound = rewind(cfg.run_dir, step, saved_at(path) if path else None,
                     keep_episodes=cfg.trainer.max_staleness > 0)
    if path:
        print(f"resumed from step {step} at {path}"
              + (f"; dropped the {rewound} recorded after it" if rewound.any else ""), flush=True)
    else:
        why = ("resume=never" if cfg.resume == "never" else
               f"no intact checkpoint in {cfg.run_dir}" if skipped else f"no checkpoint in {cfg.run_dir}")
        print(f"started fresh at step 0 ({why})"
              + (f"; dropped the earlier attempt's {rewound}" if rewound.any else ""), flush=True)
    return path


def rollout_with_retries(pool, tasks, cfg, step: int, *, servers=None, say=print, save=None):
    """Run ``tasks`` x ``rollout.group_size`` episodes; returns (trajectories, pool counters summed
    over the rollouts). A rollout in which every episode failed is run again, up to
    ``trainer.max_failed_step_retries`` times (not at all when a server process died: nothing brings
    it back); then RunFailed names the cause, before anything of the step is trained or saved."""
    from aflow_rl.rollout.pool import make_episodes

    retries = cfg.trainer.max_failed_step_retries
    pool_stats: dict[str, float] = {}
    for attempt in range(retries + 1):
        trajs = list(pool.run(make_episodes(tasks, cfg.rollout.group_size, prefix=f"s{step}-")))
        for k, v in pool.stats.items():   # counters of every rollout of the step
            pool_stats[k] = pool_stats.get(k, 0) + v
        if save is not None:
            save(trajs, attempt > 0)
        if any(t.ok for t in trajs) or not trajs:
            return trajs, pool_stats
        cause = failure_cause(trajs, servers)
        if _dead_server(servers):
            raise RunFailed(f"step {step + 1} cannot learn: every episode failed; {cause}")
        if attempt < retries:
            say(f"step {step + 1}: every episode failed ({cause}); rollout retry {attempt + 1} of {retries}")
    raise RunFailed(f"step {step + 1} cannot learn: every episode failed in {retries + 1} rollout(s) "
                    f"(trainer.max_failed_step_retries={retries}); {cause}")


def failure_cause(trajs, servers=None) -> str:
    """Why a rollout failed: the most frequent of the episodes' own errors (the last line of
    each: the exception; errors that differ only in numbers, such as timings, count as one), and
    every started server whose process has exited."""
    failed = [_last_line(t.error) or t.status for t in trajs if not t.ok]
    kinds = Counter(re.sub(r"\d+(\.\d+)?", "#", e) for e in failed)
    (kind, n), others = kinds.most_common(1)[0], len(kinds) - 1
    text = next(e for e in failed if re.sub(r"\d+(\.\d+)?", "#", e) == kind)
    cause = f"{n} of {len(trajs)} episodes: {text}" + (f" (and {others} other error(s))" if others else "")
    dead = [p for p in (servers.processes if servers is not None else []) if not p.alive]
    for proc in dead:
        code = proc.proc.returncode if proc.proc is not None else None
        cause += f"; {proc.name} ({proc.url}) is dead (exit code {code}), log {proc.log_path}"
    return cause


def _dead_server(servers) -> bool:
    return servers is not None and any(not p.alive for p in servers.processes)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


# ---------------------------------------------------------------------------------------------
# Small pieces of the loop, kept out of main() so that main() reads as the iteration.
# ---------------------------------------------------------------------------------------------


def _already_done(cfg: Config) -> bool:
    """True (and says so) when resume finds a checkpoint at trainer.max_steps: nothing to start.
    Every rank decides alone (no process group yet), so only file sizes are checked here."""
    from aflow_rl.trainer.checkpoint import read_trainer_state, resolve_resume

    path = resolve_resume(cfg.resume, cfg.run_dir, check="size")
    if path is None or read_trainer_state(path).step < cfg.trainer.max_steps:
        return False
    print(f"{cfg.run_dir} is complete ({path}, trainer.max_steps={cfg.trainer.max_steps}); to train further "
          "raise trainer.max_steps, or start over with resume=never or another run.dir")
    return True


def _pool_tags(pool_stats: dict) -> dict[str, float]:
    """The pool's own counters (pool/retries, pool/failed, worker deaths, ...) as it keeps them."""
    return {k: float(v) for k, v in pool_stats.items() if k.startswith("pool/")}


def _save_episodes(run_dir: str, step: int, trajs, append: bool = False) -> None:
    """Every completed episode of the step, as JSONL (nothing a crash later can lose);
    ``append``: a retried rollout of the same step, kept beside the failed one."""
    path = os.path.join(run_dir, "episodes", f"step_{step:06d}.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a" if append else "w") as fh:
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
    (set AFLOW_RL_TRACEBACK=1 to see it anyway); Ctrl-C says what was kept and how to go on."""
    from aflow_rl.llm.base import LLMError
    from aflow_rl.rollout.pool import PoolError
    from aflow_rl.serving.manager import ServerError
    from aflow_rl.serving.weight_sync import WeightSyncError
    from aflow_rl.trainer.checkpoint import CheckpointError

    try:
        main()
    except (ConfigError, ServerError, PoolError, WeightSyncError, LLMError, CheckpointError, RunFailed) as exc:
        if os.environ.get("AFLOW_RL_TRACEBACK"):
            raise
        sys.exit(f"config error: {exc}" if isinstance(exc, ConfigError) else f"error: {type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        if os.environ.get("AFLOW_RL_TRACEBACK"):
            raise
        _interrupted()


def _interrupted() -> None:
    """Ctrl-C: one line on rank 0 (where the last checkpoint is, the command that resumes), exit 130."""
    from aflow_rl.trainer.console import interrupted_line

    if os.environ.get("RANK", "0") == "0":
        try:
            line = interrupted_line(load_config(*_split_args(sys.argv[1:])), sys.argv[0], sys.argv[1:])
        except Exception as exc:   # the line must come out whatever state the run was in
            line = f"interrupted ({type(exc).__name__} while finding the last checkpoint: {exc})"
        print(line, file=sys.stderr, flush=True)
    sys.exit(130)


if __name__ == "__main__":
    cli()
