"""The learner: the process group, the DeepSpeed engine and reference model, and one PPO
train step over a rollout batch (every rank runs all of it; rank 0 shares the batch).

    dist = setup_distributed()                        # plain python: 1-rank group; torchrun: from env
    engine = build_engine(model_path, cfg.trainer)
    ref = load_reference(model_path, engine) if cfg.algo.kl_coef > 0 else None
    stats = train_step(engine, turns, advantages, algo=cfg.algo, ppo_epochs=cfg.trainer.ppo_epochs,
                       temperature=cfg.env.temperature, ref_model=ref, grammar_masks=masks)

Everything goes through ``deepspeed.initialize``; without CUDA DeepSpeed's CPU
accelerator runs the same code over a gloo process group. The optimizer is
DeepSpeed's ``AdamW`` entry with ``torch_adam`` (``torch.optim.AdamW``), and a
one-rank CPU group does without DeepSpeed's shared-memory comm op, so no op has
to be JIT-compiled (several CPU ranks build that op once; a line says so); a
DeepSpeed JSON (``trainer.deepspeed_config``) can switch to FusedAdam or
anything else, since its keys win.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from aflow_rl.algos.ppo import ppo_loss, truncated_is_weight
from aflow_rl.dist import rank_world
from aflow_rl.rollout.types import Turn
from aflow_rl.trainer.batch import GrammarMask, make_micro_batches, sequence_logprobs

log = logging.getLogger("aflow_rl.trainer.learner")

# ppo_loss statistics averaged over micro-batches and ranks (a fixed order for the all-reduce).
_STAT_KEYS = ("loss", "policy", "kl", "entropy", "clipfrac", "ratio", "is_weight", "logprob_mismatch")


# ---------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, local rank, torch device, backend."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed(timeout_s: float = 1800.0) -> DistInfo:
    """Join (or create) the process group DeepSpeed needs.

    Under ``torchrun`` RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* come from the
    environment. Under plain ``python`` they are absent and a one-rank group on a
    free local port is set up here. CUDA -> nccl, one GPU per local rank;
    otherwise DS_ACCELERATOR=cpu and gloo. Safe to call twice.
    """
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # skip accelerator probing (and its warning)
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("LOCAL_RANK", "0")
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(local_rank)
    import deepspeed

    if not cuda:
        _plan_shm_comm(int(os.environ["WORLD_SIZE"]), local_rank)
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s))
    dist = torch.distributed
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


SHM_OP = "deepspeed_shm_comm"


def _plan_shm_comm(world_size: int, local_rank: int) -> None:
    """DeepSpeed's CPU communicator JIT-compiles its shared-memory all-reduce op (C++ with ninja:
    about 1.5 CPU-minutes, 3 minutes and more on a busy machine) whenever it is created, whatever
    the world size. One rank never communicates, so the op is marked unavailable and DeepSpeed
    uses torch.distributed (gloo) as it does wherever the op cannot be built. Several CPU ranks do
    use it: when it is not in the extension cache yet, one line says that a compile follows."""
    import deepspeed.ops

    if world_size == 1:
        # deepspeed.ops.__compatible_ops__ is the table build_shm_op consults; DeepSpeed keeps
        # one dict per process, so the entry stays off for every communicator created here.
        deepspeed.ops.__compatible_ops__[SHM_OP] = False
        return
    from deepspeed.git_version_info import installed_ops

    if local_rank == 0 and not installed_ops.get(SHM_OP) and deepspeed.ops.__compatible_ops__.get(SHM_OP):
        cached = _cached_extension(SHM_OP)
        if cached is False:
            print(f"compiling DeepSpeed's {SHM_OP} op for {world_size} CPU ranks (once: about 1.5 CPU-minutes, "
                  "3+ on a busy machine; cached under TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions)",
                  flush=True)


def _cached_extension(name: str) -> bool | None:
    """Whether torch's JIT extension cache already holds ``name`` (None: cannot tell)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return os.path.isfile(os.path.join(_get_build_directory(name, verbose=False), f"{name}.so"))
    except Exception:   # a private helper of torch: its absence must not stop training
        return None


DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_dist_env(env: dict | None = None) -> dict:
    """A copy of ``env`` (default: os.environ) without the rendezvous variables, for launching a
    separate training process from one that already set up (or is) a process group."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k not in DIST_ENV}


def teardown_distributed() -> None:
    """Destroy the process group if one exists (end of train.py, end of a test)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def share_from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (pickled broadcast; identity with one rank).
    train.py shares each rollout batch this way: only rank 0 runs the pool."""
    rank, world = rank_world()
    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------------
# DeepSpeed config, optimizer, schedule
# ---------------------------------------------------------------------------


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier for optimizer step ``step`` (0-based): linear warmup to 1 over
    ``warmup_steps`` (the first step already gets 1/warmup_steps), then cosine decay
    to ``min_lr_ratio`` at ``total_steps``, flat after.

    DeepSpeed's WarmupCosineLR starts its warmup at 0 and leaves the first steps at
    lr 0, so this schedule is handed to ``deepspeed.initialize`` as a client scheduler.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_ds_config(tcfg: Any) -> dict:
    """The DeepSpeed config for ``TrainerConfig`` ``tcfg``, with the JSON at
    ``tcfg.deepspeed_config`` (if any) merged over it key by key.

    No ``scheduler`` entry: :func:`build_engine` passes :func:`warmup_cosine`
    unless the JSON brings its own. ``train_batch_size`` is left for DeepSpeed to
    derive (micro x accumulation x world size).
    """
    zero: dict[str, Any] = {"stage": int(tcfg.zero_stage)}
    if tcfg.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": int(tcfg.micro_batch_size),
        "gradient_accumulation_steps": int(tcfg.grad_accum),
        "gradient_clipping": float(tcfg.grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": tcfg.precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {
            "lr": float(tcfg.lr), "betas": [float(b) for b in tcfg.betas], "eps": 1e-8,
            "weight_decay": float(tcfg.weight_decay), "torch_adam": True}},
        "steps_per_print": 10**9,   # train.py logs; DeepSpeed's own progress lines stay off
        "wall_clock_breakdown": False,
    }
    if tcfg.deepspeed_config:
        path = tcfg.deepspeed_config
        try:
            with open(path) as f:
                user = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"trainer.deepspeed_config: no file {path!r}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"trainer.deepspeed_config: {path!r} is not valid JSON: {exc}") from None
        user_params = user.get("optimizer", {}).get("params", {})
        cfg = _deep_merge(cfg, user)
        offload = cfg.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
        if offload in ("cpu", "nvme") and "torch_adam" not in user_params:
            cfg["optimizer"]["params"].pop("torch_adam", None)  # ZeRO-Offload needs DeepSpeedCPUAdam
    return cfg


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on matrices, none on biases and norm gains (1-D tensors)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


# ---------------------------------------------------------------------------
# Models and engine
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _zero3_loading(ds_config: dict) -> Iterator[None]:
    """With ZeRO-3, ``from_pretrained`` inside loads the weights already partitioned
    (``deepspeed.zero.Init``) through transformers' global HfDeepSpeedConfig, which needs
    the ``accelerate`` package; without it each rank loads the full model and
    ``deepspeed.initialize`` partitions it afterwards (fine while it fits in host memory).

    The global is cleared on the way out: left set, every later ``from_pretrained`` in the
    process (an exported checkpoint read back, a model the environment loads) would come out
    partitioned as well, with 1-D placeholder weights that fail outside a DeepSpeed engine.
    The engine itself gathers its partitions through the hooks ``deepspeed.initialize`` set.
    """
    if ds_config.get("zero_optimization", {}).get("stage", 0) != 3:
        yield
        return
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        log.warning("ZeRO-3 without the accelerate package: every rank loads the full model before partitioning")
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    hf_ds = HfDeepSpeedConfig(ds_config)   # transformers holds only a weak reference to it
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del hf_ds


def load_policy(model_path: str, tcfg: Any, ds_config: dict | None = None) -> torch.nn.Module:
    """The trainable HF causal LM in fp32 (DeepSpeed keeps fp32 master weights and
    casts the module itself under bf16); under ZeRO-3 already partitioned."""
    from transformers import AutoModelForCausalLM

    ds_config = ds_config or build_ds_config(tcfg)
    with _zero3_loading(ds_config):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.config.use_cache = False
    if tcfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def build_engine(model: str | torch.nn.Module, tcfg: Any, *, ds_config: dict | None = None) -> Any:
    """``deepspeed.initialize`` the policy (a model directory or an ``nn.Module``).

    Call :func:`setup_distributed` first. The LR schedule is :func:`warmup_cosine`
    over ``tcfg.max_steps`` optimizer steps unless the DeepSpeed JSON sets a
    ``scheduler``. The engine's ``module`` is the HF model.
    """
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_config = ds_config or build_ds_config(tcfg)
    if isinstance(model, str):
        model = load_policy(model, tcfg, ds_config)
    elif tcfg.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    weight_decay = ds_config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0)

    def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(
            s, warmup_steps=tcfg.warmup_steps, total_steps=tcfg.max_steps * tcfg.ppo_epochs,
            min_lr_ratio=tcfg.min_lr_ratio))

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, weight_decay), config=ds_config,
        lr_scheduler=None if "scheduler" in ds_config else schedule)
    engine.train()
    return engine


def load_reference(model_path: str, engine: Any) -> Any:
    """The frozen reference policy for the KL term, in the engine's precision.

    Under ZeRO-3 it is partitioned like the policy (an inference-only DeepSpeed
    engine); otherwise a plain module on the engine's device. Load it only when
    ``kl_coef > 0``.
    """
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        cfg = {"train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
               "zero_optimization": {"stage": 3}, "bf16": {"enabled": engine.bfloat16_enabled()},
               "steps_per_print": 10**9}
        with _zero3_loading(cfg):
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        ref, _, _, _ = deepspeed.initialize(model=model, config=cfg)
    else:
        ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(engine.device)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


# ---------------------------------------------------------------------------
# Train step
# ---------------------------------------------------------------------------


def _local_grad_norm(engine: Any) -> float:
    """L2 norm of the (already reduced) gradients; DeepSpeed reports none at ZeRO-0 fp32."""
    sq = [p.grad.detach().float().pow(2).sum() for p in engine.module.parameters() if p.grad is not None]
    return float(torch.stack(sq).sum().sqrt()) if sq else 0.0


def train_step(engine: Any, turns: Sequence[Turn], advantages: Sequence[float] | np.ndarray, *,
               algo: Any, ppo_epochs: int = 1, temperature: float = 1.0, ref_model: Any = None,
               grammar_masks: Sequence[GrammarMask | None] | None = None, pad_id: int = 0) -> dict[str, float]:
    """PPO update on one rollout batch; every rank calls it with the same ``turns``.

    ``advantages``: one per turn. ``algo``: an ``AlgoConfig`` (clip_low/high,
    kl_coef, kl_estimator, entropy_coef, loss_agg, importance_cap).
    ``grammar_masks``: per turn a packed or boolean mask, or None (see
    :func:`aflow_rl.trainer.batch.turn_grammar_masks`).

    First ``logp_old_trainer`` is recomputed with the current weights (no grad):
    the PPO ratio's denominator and, against the server's logprobs, the truncated
    importance weight. Then ``ppo_epochs`` passes of forward / :func:`ppo_loss` /
    ``engine.backward`` / ``engine.step`` over the micro-batches; DeepSpeed steps
    the optimizer every ``grad_accum`` micro-batches. Returns stats under
    the metric tags of docs/architecture.md, averaged over micro-batches and ranks.
    """
    t0 = time.perf_counter()
    rank, world = rank_world()
    gas = engine.gradient_accumulation_steps()
    batches = [mb.to(engine.device) for mb in make_micro_batches(
        turns, advantages, micro_batch_size=engine.train_micro_batch_size_per_gpu(), grad_accum=gas,
        rank=rank, world_size=world, pad_id=pad_id, grammar_masks=grammar_masks)]
    engine.train()
    # One pass that is one optimizer step: the weights do not move before the last
    # micro-batch, so the grad forward's own detached logprobs are logp_old exactly.
    on_policy = ppo_epochs == 1 and len(batches) == gas
    old_logps, ref_logps = _fixed_logprobs(engine, batches, temperature, ref_model, need_old=not on_policy)
    tally = _Tally()
    for _ in range(ppo_epochs):
        for i, mb in enumerate(batches):
            # The optimizer-step boundary follows this batch, not DeepSpeed's running micro-step
            # counter: train.py resizes the accumulation to each rollout batch, and a counter
            # carried over from earlier batches would step mid-batch (the rest of the batch then
            # trains on moved weights, and its gradients leak into the next batch).
            _micro_step(engine, mb, (i + 1) % gas == 0, algo, temperature, old_logps[i], ref_logps[i], tally)
    return _reduced_stats(engine, tally, batches, ppo_epochs, world, t0)


def _fixed_logprobs(engine: Any, batches: list, temperature: float, ref_model: Any, *, need_old: bool
                    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Before any update, without grad: per micro-batch ``logp_old`` (unless ``need_old`` is
    False: the pass is on-policy) and the reference model's logprobs (when there is one)."""
    old_logps: list[torch.Tensor | None] = [None] * len(batches)
    ref_logps: list[torch.Tensor | None] = [None] * len(batches)
    with torch.no_grad():
        for i, mb in enumerate(batches):
            if need_old:
                old_logps[i] = sequence_logprobs(engine, mb, temperature)[0]
            if ref_model is not None:
                ref_logps[i] = sequence_logprobs(ref_model, mb, temperature)[0]
    return old_logps, ref_logps


@dataclass
class _Tally:
    """This rank's running sums over a train step's micro-batches."""

    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    counted: int = 0                                     # micro-batches with response tokens
    grad_norms: list[float] = field(default_factory=list)   # one per optimizer step
    lrs: list[float] = field(default_factory=list)


def _micro_step(engine: Any, mb: Any, boundary: bool, algo: Any, temperature: float,
                old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None, tally: _Tally) -> None:
    """Forward, :func:`ppo_loss`, backward and ``engine.step`` of one micro-batch; the optimizer
    steps when ``boundary``. ``old_logp`` None: on-policy, the forward's own detached logprobs."""
    engine.set_gradient_accumulation_boundary(boundary)
    logp, entropy = sequence_logprobs(engine, mb, temperature, entropy_grad=algo.entropy_coef != 0)
    old_logp = logp.detach() if old_logp is None else old_logp
    is_weight = (truncated_is_weight(old_logp, mb.server_logprobs, algo.importance_cap)
                 if algo.importance_cap > 0 else None)
    loss, stats = ppo_loss(
        logp, old_logp, mb.advantages, mb.response_mask,
        clip_low=algo.clip_low, clip_high=algo.clip_high, agg=algo.loss_agg,
        ref_logp=ref_logp, kl_coef=algo.kl_coef, kl_estimator=algo.kl_estimator,
        entropy=entropy, entropy_coef=algo.entropy_coef, is_weight=is_weight,
        server_logp=mb.server_logprobs)
    engine.backward(loss)
    stepping = engine.is_gradient_accumulation_boundary()
    own_norm = None
    if stepping:
        tally.lrs.append(float(engine.get_lr()[0]))
        if engine.zero_optimization_stage() == 0:
            own_norm = _local_grad_norm(engine)
    engine.step()
    if stepping:
        norm = engine.get_global_grad_norm()
        tally.grad_norms.append(float(norm) if norm is not None else float(own_norm or 0.0))
    if mb.num_response_tokens > 0:   # stand-in micro-batches carry no statistics
        tally.counted += 1
        for k, v in stats.items():
            tally.sums[k] += v


def _reduced_stats(engine: Any, tally: _Tally, batches: list, ppo_epochs: int, world: int,
                   t0: float) -> dict[str, float]:
    """The step's statistics averaged over micro-batches and ranks, under the metric tags."""
    tokens = sum(mb.num_tokens for mb in batches if mb.num_response_tokens > 0) * ppo_epochs
    keys = _STAT_KEYS
    local = torch.tensor([tally.sums[k] for k in keys] + [float(tally.counted), float(tokens)],
                         dtype=torch.float64, device=engine.device)
    if world > 1:
        torch.distributed.all_reduce(local)
    total = local.tolist()
    n = max(total[len(keys)], 1.0)
    mean = {k: total[j] / n for j, k in enumerate(keys)}
    elapsed = time.perf_counter() - t0
    return {
        "losses/total": mean["loss"],
        "losses/policy": mean["policy"],
        "losses/kl": mean["kl"],
        "losses/clipfrac": mean["clipfrac"],
        "losses/entropy": mean["entropy"],
        "losses/ratio": mean["ratio"],
        "losses/is_weight": mean["is_weight"],
        "losses/grad_norm": float(np.mean(tally.grad_norms)) if tally.grad_norms else 0.0,
        "charts/lr": tally.lrs[-1] if tally.lrs else float(engine.get_lr()[0]),
        "charts/optimizer_steps": float(len(tally.grad_norms)),
        "perf/logprob_mismatch": mean["logprob_mismatch"],
        "perf/tokens_per_s": total[len(keys) + 1] / max(elapsed, 1e-9),
        "timing/train_s": elapsed,
    }
