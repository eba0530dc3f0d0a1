"""Typed run configuration: YAML recipes plus ``key=value`` overrides.

Every field has a default and one line of help (``python train.py --help``
prints them all). Loading is strict, in the spirit of torchtune recipes and
TRL's config dataclasses: an unknown key is an error that names the closest
valid key, a value of the wrong type names the field and the expected type,
and a missing file says so. A duplicate YAML key, a syntax error (with its line and
column) and any value that would make a run train nothing or crash later (``validate``:
group_size < 2, non-positive timeouts, step intervals < 1, non-finite floats, a missing
resume path, a file as run.dir) are one-line errors at load time. ``save_resolved``
writes the final config into ``run.dir`` with secrets redacted (``aflow_rl/redaction.py``).
docs/security.md lists every rule.

    cfg = load_config("configs/quickstart.yaml", ["trainer.max_steps=5"])
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from aflow_rl.redaction import redact  # noqa: F401  (re-exported: config.redact is public)


class ConfigError(ValueError):
    """A config problem, phrased as a single line that says what to fix."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with a default and its one line of help."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    if dataclasses.is_dataclass(default) and isinstance(default, type):
        return field(default_factory=default, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------


@dataclass
class RunConfig:
    name: str = _f("aflow_rl", "Run name; also the default folder under runs/.")
    dir: str = _f("", "Everything the run writes goes below this folder (empty: runs/<name>).")
    seed: int = _f(0, "Global seed for tasks, sampling and initialisation.")


@dataclass
class ServerConfig:
    backend: Literal["embedded", "sglang", "external", "none"] = _f(
        "embedded", "embedded (CPU server in this package) | sglang (launch_server) | external (URLs) | none.")
    model_path: str = _f("", "Hugging Face model directory served by this role.")
    build_tiny: str = _f("", "tiny | mid | small: if model_path holds no model, build the offline tiny model there first.")
    urls: list[str] = _f([], "external backend: server base URLs, e.g. http://10.0.0.5:30000.")
    num_servers: int = _f(1, "How many server processes to start for this role (load-balanced).")
    host: str = _f("127.0.0.1", "Address the started servers bind to.")
    port: int = _f(0, "First port for started servers (0: pick free ports).")
    tp: int = _f(1, "sglang: tensor-parallel size per server.")
    mem_fraction: float = _f(0.8, "sglang: --mem-fraction-static.")
    dtype: str = _f("auto", "Weights dtype on the server: auto | float32 | bfloat16 | float16.")
    context_length: int = _f(0, "Maximum prompt+output tokens (0: the model's max_position_embeddings).")
    max_batch_size: int = _f(64, "embedded: most sequences decoded together in one batch.")
    threads: int = _f(0, "embedded: torch CPU threads per server process (0: torch's default).")
    device: str = _f("cpu", "embedded: cpu | cuda | cuda:N, where the weights, forwards and KV cache live (a frozen executor on a GPU beside the trainer, say); sampling and grammars stay on the CPU.")
    base_gpu_id: int = _f(0, "sglang: first GPU of this role; server i uses GPUs base_gpu_id + i*tp onwards.")
    extra_args: list[str] = _f([], "sglang: extra command-line arguments for launch_server.")
    router: bool = _f(False, "sglang: put the servers behind sglang_router and use its URL as the endpoint.")
    startup_timeout_s: float = _f(300.0, "Seconds to wait for /health before giving up.")
    stop_grace_s: float = _f(10.0, "Seconds between SIGTERM and SIGKILL when stopping started servers.")


@dataclass
class ServingConfig:
    policy: ServerConfig = _f(ServerConfig, "The trained orchestrator's servers.")
    actor: ServerConfig = _f(ServerConfig, "The frozen actor / subagent / executor servers.")


@dataclass
class ClientConfig:
    provider: Literal["sglang", "openai", "anthropic"] = _f(
        "sglang", "sglang (native /generate, token ids + logprobs) | openai (chat API) | anthropic (Messages API).")
    base_url: str = _f("", "Endpoint base URL (empty: the URL of the servers started for this role).")
    model: str = _f("", "Model name sent to OpenAI-compatible or Anthropic APIs.")
    api_key_env: str = _f("", "Env var with the API key; if set it must exist. Empty: no key (anthropic and openai on a non-local/non-private host then fail at start-up).")
    timeout_s: float = _f(120.0, "Deadline of one request in seconds, retries and backoff included.")
    max_retries: int = _f(3, "Retries on connection errors, 429 and 5xx (never on other 4xx).")
    backoff_s: float = _f(0.5, "Base of the jittered exponential backoff between retries.")
    max_concurrency: int = _f(64, "Most requests in flight per endpoint from one process.")
    balance: Literal["least_in_flight", "round_robin"] = _f(
        "least_in_flight", "How requests spread over several URLs: least_in_flight | round_robin.")


@dataclass
class LLMConfig:
    policy: ClientConfig = _f(ClientConfig, "Client for the orchestrator (training needs provider=sglang).")
    actor: ClientConfig = _f(ClientConfig, "Client for the actor / subagents / executor.")


@dataclass
class RolloutConfig:
    backend: Literal["loky", "threading", "sequential", "dask"] = _f(
        "loky", "Where episodes run: loky (local worker processes; the name is historical) | threading | "
                "sequential (debug) | dask (many machines).")
    workers: int = _f(2, "Worker processes (or threads).")
    concurrency_per_worker: int = _f(16, "Episodes run at once inside one worker with asyncio.")
    episode_timeout_s: float = _f(300.0, "Wall-clock limit of one episode attempt.")
    max_attempts: int = _f(2, "Attempts per episode before it is returned as failed.")
    timeout_grace_s: float = _f(10.0, "Seconds past episode_timeout_s before a silent worker (blocked event loop) is killed and replaced.")
    start_timeout_s: float = _f(300.0, "Seconds a worker may take to start (spawn, import the worker module, init_worker).")
    dask_address: str = _f("", "dask backend: scheduler address, e.g. tcp://10.0.0.1:8786.")
    group_size: int = _f(4, "Episodes per task (G): one GRPO/GiGPO group.")
    tasks_per_step: int = _f(4, "Tasks per iteration (B); B x G episodes per rollout.")
    num_tasks: int = _f(0, "Size of a fixed task set, reshuffled each epoch (0: an endless stream of fresh tasks).")
    trace: bool = _f(True, "Append step events as JSONL under run.dir/traces.")


@dataclass
class SwarmEnvConfig:
    suite: Literal["wide", "deep", "mixed"] = _f("wide", "Task family: wide (independent items) | deep (dependent hops) | mixed.")
    min_items: int = _f(3, "Fewest items (or hops) in a generated task.")
    max_items: int = _f(6, "Most items (or hops) in a generated task.")
    subagents: Literal["simulated", "llm"] = _f("simulated", "Subagent pool: simulated profiles or the actor LLM.")
    max_steps: int = _f(24, "Orchestrator turns per episode (a single agent needs ~3 per wide item).")
    max_concurrent_subagents: int = _f(8, "Cap on subagents running at once.")
    max_tool_calls: int = _f(16, "Budget of the orchestrator's own tool calls per episode (subagents: profile limits).")
    max_tokens: int = _f(20000, "Token budget (orchestrator + subagents) per episode.")
    max_wall_s: float = _f(120.0, "Wall-clock budget per episode.")
    subtask_retries: int = _f(1, "Automatic retries of a failed subtask.")
    format_penalty: float = _f(-0.1, "Reward added for each unparseable or invalid action.")
    policy: Literal["model", "single", "heuristic", "bandit", "adaptive"] = _f(
        "model", "Orchestrator: model (policy server) | single | heuristic | bandit (baselines, no server) | adaptive (structure-aware reference rule: the headroom over the baselines).")
    action_schema: bool = _f(True, "Constrain model turns with the action JSON schema (false: free text).")
    task_schema: bool = _f(False, "Narrow the action schema each turn to the task's item ids, existing subagents and the cap.")
    effective_actions: bool = _f(False, "With task_schema: the grammar admits only actions that change the state (spawn delegates whole dependency levels of unplanned items in order; join only while work is queued; replan only on failed or queued work; finish alone once all is answered).")
    prompt: Literal["full", "compact", "shape", "graph"] = _f("full", "Observation text: full (documented actions and tools) | compact (state only) | shape (compact + the task's width, depth, lookups and own tool calls left) | graph (shape + a last line 'Graph: parallel|serial|parallel then serial' from the items' dependencies).")
    auto_answer: bool = _f(False, "Score the subagents' collected results as the answer (finish's own entries fill gaps).")
    kb_seed: int = _f(0, "Seed of the local knowledge base that tasks are asked about.")
    bandit_latency_coef: float = _f(0.02, "bandit baseline: its reward is item_f1 - coef * critical_steps.")
    latency_coef: float = _f(0.0, "Latency cost c of the task reward: r_perf = item_f1 - c * critical_steps (0: quality only). Not annealed, so it still applies once PARL's lambdas are 0.")
    no_duplicate_work: bool = _f(False, "With effective_actions: solve only items no subagent holds or answered, and spawn at most one subagent per delegated item.")
    spawn_n: Literal["choose", "width"] = _f("choose", "With no_duplicate_work: choose (the policy picks a spawn's n, 1..items delegated) | width (the grammar fixes n to the widest dependency level delegated: one subagent per item that can run at once).")
    spawn_profile: Literal["choose", "small", "medium", "large"] = _f("choose", "With task_schema: choose (the policy picks a spawn's profile) | small | medium | large (the grammar fixes it; large never reports a wrong answer, the heuristic's rule).")
    delegate_ops: bool = _f(True, "With effective_actions: false keeps op items (sums of other items' answers) out of spawns while the orchestrator has a tool call and a turn left (its own solve computes one with a single calc; a subagent adds a spawn, a wave and a join).")
    solve_action: bool = _f(False, "Offer the action {\"action\":\"solve\",\"subtask\":ID}: the orchestrator works an item itself, one main step and one tool call per lookup (serial work).")
    mix: list[str] = _f([], "Suites of a mixed task distribution, e.g. [wide, deep, mixed]: each task draws its suite (empty: suite alone).")
    curriculum: list[int] = _f([], "Curriculum over mix: the optimizer step at which each suite of mix joins the draw (same length as mix, first 0; e.g. [0, 40, 80] for wide -> deep -> mixed). Empty: all from step 0.")
    item_range: dict[str, list[int]] = _f({}, "Per-suite [min, max] items (hops), e.g. {wide: [6, 10], deep: [3, 6]}; suites not named use min_items..max_items.")
    draw: Literal["random", "balanced"] = _f("random", "How each task picks its suite from the current stage: random (a hash of seed and index) | balanced (round-robin over the task sampler's position, so every optimizer step trains each suite equally often when tasks_per_step is a multiple of the suites; evaluation sets stay random).")
    items_ramp_steps: int = _f(0, "Curriculum over item counts: a suite's most items grow linearly from its min to its max over this many steps after it joins (0: full range at once).")
    bandit_ucb_c: float = _f(0.1, "bandit baseline: UCB1 exploration coefficient.")


@dataclass
class PlanActConfig:
    dataset: str = _f("basic_arithmetic", "reasoning-gym dataset name for plan_act tasks.")
    timeout_s: float = _f(30.0, "Seconds the planner has to answer before the fallback.")
    fallback_on_timeout: bool = _f(True, "On planner timeout, let the actor solve the task alone.")
    max_plan_tokens: int = _f(256, "Most tokens in a plan.")
    max_act_tokens: int = _f(128, "Most tokens per actor step.")
    max_steps: int = _f(4, "Most plan steps the actor executes (later steps merge into the last).")
    actor_temperature: float = _f(0.0, "Sampling temperature of the frozen actor (0: greedy).")
    format_penalty: float = _f(-0.1, "Reward added when the plan is empty or has no numbered steps.")


@dataclass
class AflowConfig:
    dataset: str = _f("humaneval", "humaneval | rg:<reasoning-gym name> | <gsm8k|math|humaneval|mbpp|hotpotqa|drop>:<path.jsonl> (AFlow format).")
    num_problems: int = _f(0, "Problems taken from the dataset before the split (0: all).")
    val_ratio: float = _f(0.2, "Share of problems in the validation split (AFlow's 1:4 validation:test).")
    split_seed: int = _f(42, "Seed of the validation/test split.")
    max_nodes: int = _f(8, "Complexity limit: most operator nodes in a workflow.")
    problem_timeout_s: float = _f(60.0, "Wall-clock limit for one workflow execution on one problem.")
    eval_concurrency: int = _f(8, "Problems evaluated at once by one evaluation.")
    validation_runs: int = _f(1, "Evaluations of each child on the validation split (scores averaged).")
    max_rounds: int = _f(20, "Optimisation rounds of the search.")
    top_k: int = _f(3, "selection=aflow: the parent is drawn from the best top_k rounds (round 1 always included).")
    selection: Literal["aflow", "mcts"] = _f("mcts", "Parent selection: aflow (soft-mixed prior) | mcts (prior + experience Q-values).")
    prior_weight: float = _f(0.5, "MCTS: weight w of AFlow's score prior against a uniform one in PUCT (0: Q and visit counts only).")
    q_prior_count: float = _f(1.0, "MCTS: pseudo-visits n0 shrinking an option's mean improvement toward 0 (no expected gain).")
    c_puct: float = _f(0.5, "MCTS: weight c of the PUCT exploration term c*prior*sqrt(N(parent))/(1+N(child)).")
    format_penalty: float = _f(-0.1, "Reward of an invalid or unchanged proposal (never executed); also its recorded improvement.")
    initial_workflow: str = _f("", "YAML file of the round-1 workflow (empty: AFlow's single generation node).")
    prompt: Literal["full", "compact"] = _f("full", "Optimizer prompt: full (operator docs, failures) | compact (no operator docs, shorter excerpts: small contexts).")
    convergence_rounds: int = _f(5, "Stop when the top 3 rounds are unchanged for this many rounds.")
    failures_shown: int = _f(3, "Failed validation problems shown to the optimizer per proposal.")
    executor_max_tokens: int = _f(512, "Most tokens per operator call on the executor (actor) model.")
    max_samples: int = _f(5, "Complexity limit: most samples of a generator node, candidates of an ensemble, MdEnsemble votes.")
    max_loop_rounds: int = _f(3, "Complexity limit: most Revise max_rounds, Test max_fixes, Programmer attempts.")
    code_timeout_s: float = _f(10.0, "Sandbox wall-clock limit of one Programmer/Test code run.")
    instructions: list[str] = _f([], "Grammar narrowing: when non-empty, every instruction the optimizer proposes is one of these strings (\"\" for none) instead of free text, so a small policy proposes structures, not random prompt text. Empty: free text.")
    temperatures: list[float] = _f([], "Grammar narrowing: when non-empty, a node's proposed temperature is one of these values instead of any number in [0, 2]. Empty: any.")
    episode_rounds: int = _f(1, "Training: optimisation rounds per episode (propose -> evaluate -> propose from the result); > 1 gives GiGPO anchor-state groups.")
    scoring: Literal["default", "aflow"] = _f("default", "Benchmark verdicts: default (complete number/LaTeX reading) | aflow (AFlow's own scorers, comparable with its published table); docs/scoring.md.")


@dataclass
class EnvConfig:
    name: str = _f("swarm", "The environment: swarm | plan_act | aflow (workers/<name>.py), or the dotted module path of your own worker module (make_tasks, init_worker, run_episode; docs/architecture.md).")
    temperature: float = _f(1.0, "Orchestrator sampling temperature (the trainer recomputes logprobs with it).")
    max_new_tokens: int = _f(96, "Most tokens per orchestrator turn.")
    swarm: SwarmEnvConfig = _f(SwarmEnvConfig, "Swarm environment.")
    plan_act: PlanActConfig = _f(PlanActConfig, "Plan/Act environment (planner + actor).")
    aflow: AflowConfig = _f(AflowConfig, "AFlow workflow search.")


@dataclass
class ParlConfig:
    lambda1: float = _f(0.1, "Initial weight of r_parallel (PARL instantiation reward).")
    lambda2: float = _f(0.1, "Initial weight of r_finish (PARL sub-task completion reward).")
    anneal_steps: int = _f(100, "Optimizer steps over which lambda1 and lambda2 fall linearly to 0.")


@dataclass
class AlgoConfig:
    adv_estimator: Literal["grpo", "gigpo"] = _f("grpo", "Advantage estimator: grpo (episode groups) | gigpo (+ anchor-state step groups).")
    norm_std: bool = _f(True, "GRPO: divide by the group's sample std (False: mean-centering only).")
    gamma: float = _f(1.0, "GiGPO: discount of the step return R_t.")
    omega: float = _f(1.0, "GiGPO: weight of the step advantage A^S.")
    gigpo_mode: Literal["mean_norm", "mean_std_norm"] = _f("mean_norm", "GiGPO normaliser F: 1 (mean_norm) or std+eps (mean_std_norm).")
    clip_low: float = _f(0.2, "PPO-clip lower epsilon: ratio >= 1 - clip_low.")
    clip_high: float = _f(0.28, "PPO-clip upper epsilon: ratio <= 1 + clip_high (clip-higher).")
    kl_coef: float = _f(0.0, "KL penalty to the frozen reference (0: no reference model is loaded).")
    kl_estimator: Literal["k1", "k3"] = _f("k3", "KL estimator: k1 (log ratio) | k3 (unbiased, non-negative).")
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient.")
    loss_agg: Literal["token_mean", "seq_mean"] = _f("token_mean", "Loss aggregation: mean over tokens | mean of per-sequence means.")
    importance_cap: float = _f(2.0, "Cap C of the truncated importance weight min(exp(logp_trainer - logp_server), C); 0 disables.")
    parl: ParlConfig = _f(ParlConfig, "PARL reward shaping.")


@dataclass
class TrainerConfig:
    max_steps: int = _f(10, "Training iterations (rollout + update); each makes ppo_epochs optimizer steps.")
    epochs: int = _f(0, "Passes over rollout.num_tasks; when > 0 it sets max_steps = ceil(epochs * num_tasks / tasks_per_step).")
    require_cuda: bool = _f(False, "Stop at start-up unless CUDA is available (GPU recipes set it).")
    lr: float = _f(1e-5, "Peak learning rate (AdamW).")
    min_lr_ratio: float = _f(0.1, "Cosine decay ends at lr * min_lr_ratio.")
    warmup_steps: int = _f(0, "Linear warmup steps.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    betas: list[float] = _f([0.9, 0.999], "AdamW betas.")
    grad_clip: float = _f(1.0, "Gradient-norm clipping (0 disables).")
    micro_batch_size: int = _f(4, "Sequences per forward/backward on one rank.")
    grad_accum: int = _f(1, "Micro-batches per optimizer step when building the engine; train.py then sizes it so one rollout batch is one step per PPO epoch.")
    ppo_epochs: int = _f(1, "Passes over each rollout batch.")
    zero_stage: int = _f(0, "DeepSpeed ZeRO stage 0-3.")
    precision: Literal["fp32", "bf16"] = _f("fp32", "Training precision (bf16 on GPUs).")
    deepspeed_config: str = _f("", "Path to a DeepSpeed JSON; its keys override the ones built from this section.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    sync_every: int = _f(1, "Push weights to the policy servers every N optimizer steps.")
    max_staleness: int = _f(0, "Asynchronous training: k >= 1 keeps the rollout running while the trainer trains; an episode group starts only while it will be trained at most k optimizer steps after the step whose weights sample it (admission control), batches are trained oldest first and no completed episode is discarded. 0: the synchronous loop (rollout, train, sync).")
    save_every: int = _f(50, "Checkpoint every N optimizer steps (and at the end).")
    keep_last: int = _f(3, "Checkpoints kept (older ones are deleted).")
    log_every: int = _f(1, "TensorBoard scalars every N steps.")
    sample_every: int = _f(10, "TensorBoard text samples of episodes every N steps.")
    sync_timeout_s: float = _f(120.0, "Seconds a weight sync may take before it is an error.")
    sync_inflight: bool = _f(False, "Update the servers' weights without waiting for running requests: /pause_generation -> update -> /continue_generation (continue on every failure too); a turn running across the update finishes under the new weights and reports the new weight_version. false: the update waits until running requests finish.")
    sync_pause_mode: Literal["in_place", "retract"] = _f("in_place", "With sync_inflight, SGLang's pause mode: in_place (running requests keep their KV) | retract (their KV is recomputed under the new weights); not abort, which would drop every running episode. Real SGLang 0.5.x cannot flush its radix cache with requests paused in place, so the update fails loudly there: use retract with real SGLang.")
    sync: Literal["disk", "distributed"] = _f("disk", "How weights reach the policy servers: disk (a Hugging Face directory, /update_weights_from_disk) | distributed (SGLang's /update_weights_from_distributed: rank 0 broadcasts them in buckets over a torch.distributed group; docs/multinode.md).")
    sync_bucket_mb: float = _f(512.0, "sync=distributed: megabytes of parameters per broadcast bucket (under ZeRO-3 also the most gathered at once).")
    sync_backend: Literal["auto", "gloo", "nccl"] = _f("auto", "sync=distributed: group backend; auto = nccl when CUDA is available and the policy servers are SGLang, else gloo (the embedded server needs gloo).")
    sync_master_address: str = _f("127.0.0.1", "sync=distributed: address of trainer rank 0 that every policy server can reach (it hosts the group's rendezvous).")
    sync_master_port: int = _f(0, "sync=distributed: rendezvous port on sync_master_address; 0 picks a free one.")
    max_failed_step_retries: int = _f(2, "Rollouts of a step run again when every episode failed (a dead server, a broken worker); then the run stops with the episodes' error, without a checkpoint.")
    checkpoint_check: Literal["sha256", "size"] = _f("sha256", "How checkpoints are verified before resuming: sha256 (manifest hashes, reads every byte) | size (file sizes only, for very large checkpoints).")


@dataclass
class SandboxConfig:
    allow_unisolated: bool = _f(False, "Run generated code even where the sandbox has only basic isolation (no jail: not root, not Linux); basic mode does not contain hostile code (docs/security.md).")


@dataclass
class Config:
    run: RunConfig = _f(RunConfig, "Run identity and output folder.")
    resume: str = _f("auto", "auto (newest complete checkpoint in run.dir) | never | a checkpoint path.")
    serving: ServingConfig = _f(ServingConfig, "Inference servers per role.")
    llm: LLMConfig = _f(LLMConfig, "Inference clients per role.")
    rollout: RolloutConfig = _f(RolloutConfig, "Episode pool.")
    env: EnvConfig = _f(EnvConfig, "Environment.")
    algo: AlgoConfig = _f(AlgoConfig, "Advantages, loss and reward shaping.")
    trainer: TrainerConfig = _f(TrainerConfig, "Optimisation.")
    sandbox: SandboxConfig = _f(SandboxConfig, "Where generated code runs (env aflow: Programmer, Test, code scoring).")

    @property
    def run_dir(self) -> str:
        return self.run.dir or os.path.join("runs", self.run.name)


# ---------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, dict):
        return repr(tp).replace("typing.", "")
    return getattr(tp, "__name__", repr(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: expected one of {_type_name(tp)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _coerce(value, arm, key)
            except ConfigError:
                pass
        raise bad
    if tp is type(None):
        if value is None:
            return None
        raise bad
    if origin is list:
        if not isinstance(value, list):
            raise bad
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad
        try:
            number = float(value)
        except OverflowError:  # a 400-digit integer
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{key}: must be a finite number, got {value!r:.40}; write a number such as 1e-5")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if tp is Any:
        return value
    raise bad  # pragma: no cover - every annotation above is handled


def _worker_replacement(value: Any) -> str:
    """The ``env.name`` that replaces an old ``rollout.worker: module:function`` value."""
    module = str(value or "").partition(":")[0].strip()
    shipped = {"workers.swarm_worker": "swarm", "workers.aflow_worker": "aflow"}
    return shipped.get(module, module or "swarm")


# Keys that existed once: loading one is an error naming what replaced it (never silently ignored).
_REMOVED = {
    "rollout.worker": lambda v: f"rollout.worker was removed: set env.name: {_worker_replacement(v)} "
                                "(env.name picks the environment and its worker module)",
    "env.mode": lambda v: f"env.mode was removed: set env.name: {v if v in ('swarm', 'plan_act') else 'swarm'} "
                          "(Plan/Act is its own environment now)",
}


def _build(cls: type, data: dict, prefix: str) -> Any:
    """Instantiate dataclass ``cls`` from a nested dict, strictly."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = prefix + str(key)
        if full in _REMOVED:
            raise ConfigError(_REMOVED[full](value))
        if key not in names:
            valid = [prefix + n for n in names]
            close = difflib.get_close_matches(full, valid, n=1, cutoff=0.5) or difflib.get_close_matches(
                full, all_keys(), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else f"valid keys here: {', '.join(valid)}"
            raise ConfigError(f"unknown config key '{full}': {hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, full + ".")
        else:
            kwargs[key] = _coerce(value, tp, full)
    return cls(**kwargs)


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the config, in declaration order."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += all_keys(hints[f.name], prefix + f.name + ".")
        else:
            out.append(prefix + f.name)
    return out


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not key=value (e.g. trainer.lr=1e-6)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{item}' has an empty key")
    # YAML parses numbers, booleans, lists ([a, b]) and null; a bare word stays a string.
    value = _parse_override_value(raw, key) if raw.strip() else ""
    # YAML 1.1 reads 1e-6 as a string; a float field deserves the float.
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value.strip()):
        value = float(value)
    return key.split("."), value


def _parse_override_value(raw: str, key: str) -> Any:
    """YAML for one override value (strict: ``k={a: 1, a: 2}`` is a duplicate); not YAML -> the raw string."""
    loader = _StrictLoader(raw)
    loader.name = f"override {key}="
    try:
        return loader.get_single_data()
    except yaml.YAMLError:
        return raw
    finally:
        loader.dispose()


def _merge(base: dict, path: list[str], value: Any) -> None:
    node = base
    for part in path[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node = nxt
    node[path[-1]] = value


def _fix_yaml_floats(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _fix_yaml_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_fix_yaml_floats(v) for v in node]
    if isinstance(node, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", node.strip()):
        return float(node)
    return node


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping, at any depth.

    PyYAML keeps the last of two equal keys without a word, so a second ``trainer:``
    block silently replaced the first one. Merge keys (``<<: *base``) may still be
    overridden: only keys written out in the same mapping are compared.
    """

    def check_unique(self, node: yaml.Node, path: str = "") -> None:
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.check_unique(item, f"{path}[{i}]")
        if not isinstance(node, yaml.MappingNode):
            return
        seen: dict = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            full = f"{path}.{key}" if path else str(key)
            if key is not None and key_node.tag != "tag:yaml.org,2002:merge":
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise ConfigError(f"{self.name}:{line}: duplicate key '{full}' (first at line {seen[key]}); "
                                      "a repeated key silently replaces the first one: merge the two into one")
                seen[key] = line
            self.check_unique(value_node, full)

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        self.check_unique(node)
        return self.construct_document(node)


def _read_yaml(stream: Any, path: str) -> Any:
    """Parse a recipe strictly; a syntax error keeps its line and column (1-based)."""
    loader = _StrictLoader(stream)
    loader.name = path
    try:
        return loader.get_single_data() or {}
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        what = "; ".join(x for x in (exc.context, exc.problem) if x)
        hint = " (YAML indents with spaces, not tabs)" if "'\\t'" in what else ""
        raise ConfigError(f"{where}: not valid YAML: {what}{hint}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    finally:
        loader.dispose()


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML recipe (optional), apply ``key=value`` overrides, validate."""
    data: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path} (configs/ has the shipped recipes)")
        with open(path) as fh:
            data = _read_yaml(fh, path)
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    data = _fix_yaml_floats(data)
    for item in overrides:
        keys, value = _parse_override(item)
        _merge(data, keys, value)
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field checks that types alone cannot express."""
    _validate_minimums(cfg)
    _validate_durations(cfg)
    if cfg.trainer.epochs > 0:
        if cfg.rollout.num_tasks < 1:
            raise ConfigError("trainer.epochs needs a fixed task set: set rollout.num_tasks")
        cfg.trainer.max_steps = -(-cfg.trainer.epochs * cfg.rollout.num_tasks // cfg.rollout.tasks_per_step)
    if cfg.env.swarm.min_items > cfg.env.swarm.max_items:
        raise ConfigError("env.swarm.min_items must not exceed env.swarm.max_items")
    _validate_task_mix(cfg.env.swarm)
    _validate_paths(cfg)
    for role in ("policy", "actor"):
        server: ServerConfig = getattr(cfg.serving, role)
        if server.backend == "external" and not server.urls:
            raise ConfigError(f"serving.{role}.urls: the external backend needs at least one URL")
        if server.num_servers < 1:
            raise ConfigError(f"serving.{role}.num_servers: must be at least 1")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", server.device):
            raise ConfigError(f"serving.{role}.device: expected cpu, cuda or cuda:N, got {server.device!r}")
        if server.device != "cpu" and server.backend != "embedded":
            raise ConfigError(f"serving.{role}.device: only the embedded backend takes a device (SGLang servers "
                              f"place themselves with tp and base_gpu_id); remove it or set backend: embedded")
    _validate_sync(cfg)
    if cfg.rollout.backend == "dask" and not cfg.rollout.dask_address:
        raise ConfigError("rollout.dask_address: the dask backend needs a scheduler address (tcp://host:8786)")
    _validate_env_name(cfg.env.name)


def _validate_sync(cfg: Config) -> None:
    t = cfg.trainer
    if t.sync != "distributed":
        return
    if t.sync_bucket_mb <= 0:
        raise ConfigError(f"trainer.sync_bucket_mb: must be positive, got {t.sync_bucket_mb:g} (try 512)")
    if not 0 <= t.sync_master_port <= 65535:
        raise ConfigError(f"trainer.sync_master_port: {t.sync_master_port} is not a port (0 picks a free one)")
    if t.sync_inflight:   # pausing around a bucketed broadcast is not built: say so rather than ignore it
        raise ConfigError("trainer.sync_inflight=true works with trainer.sync=disk only; with sync=distributed "
                          "set trainer.sync_inflight=false (each bucket then waits for running requests)")
    if t.sync_backend == "nccl" and cfg.serving.policy.backend == "embedded":
        raise ConfigError("trainer.sync_backend=nccl: the embedded policy server runs on CPU and joins over gloo; "
                          "set trainer.sync_backend=gloo (or auto)")


# Integer keys below which a run trains nothing or crashes mid-way: (minimum, what to do instead).
_MINIMUMS = {
    "trainer.max_steps": (1, "the number of training iterations"),
    "rollout.workers": (1, "worker processes"),
    "rollout.concurrency_per_worker": (1, "episodes at once per worker"),
    "rollout.max_attempts": (1, "attempts per episode"),
    "rollout.group_size": (2, "GRPO/GiGPO advantages compare the episodes of one group, so a group of 1 "
                              "has zero advantage and trains nothing"),
    "rollout.tasks_per_step": (1, "tasks per iteration"),
    "env.swarm.max_steps": (1, "orchestrator turns per episode"),
    "env.aflow.episode_rounds": (1, "optimisation rounds per AFlow training episode"),
    "trainer.ppo_epochs": (1, "passes over each batch; 0 makes no update"),
    "trainer.micro_batch_size": (1, "sequences per forward/backward"),
    "trainer.grad_accum": (1, "micro-batches per optimizer step"),
    "trainer.save_every": (1, "checkpoint every N steps; the last step is always saved, so "
                              "save_every >= trainer.max_steps saves only at the end"),
    "trainer.sync_every": (1, "weight syncs every N steps; a value above trainer.max_steps never syncs"),
    "trainer.log_every": (1, "scalars every N steps"),
    "trainer.sample_every": (1, "text samples every N steps; a value above trainer.max_steps logs only step 0"),
    "trainer.max_failed_step_retries": (0, "retries of a step whose episodes all failed"),
    "trainer.max_staleness": (0, "optimizer steps an episode may lag the policy it is trained on; "
                                 "0 is the synchronous loop"),
    "serving.policy.num_servers": (1, "server processes of the role"),
    "serving.actor.num_servers": (1, "server processes of the role"),
}


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _validate_minimums(cfg: Config) -> None:
    for key, (low, why) in _MINIMUMS.items():
        value = _get(cfg, key)
        if value < low:
            raise ConfigError(f"{key}: must be at least {low}, got {value} ({why})")
    if cfg.trainer.lr <= 0:
        raise ConfigError(f"trainer.lr: must be positive, got {cfg.trainer.lr:g} (0 trains nothing; try 1e-6 to 1e-5)")


def _duration_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every float key in seconds (its name ends in _s), found from the dataclasses."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _duration_keys(hints[f.name], prefix + f.name + ".")
        elif f.name.endswith("_s") and hints[f.name] is float:
            out.append(prefix + f.name)
    return out


def _validate_durations(cfg: Config) -> None:
    """A limit (``*timeout_s``, ``max_wall_s``) must be > 0: at 0 or below every episode, request or
    start-up fails at once. A pause (``*grace_s``, ``backoff_s``) may be 0 but not negative."""
    for key in _duration_keys():
        value = _get(cfg, key)
        name = key.rsplit(".", 1)[-1]
        if name.endswith(("timeout_s", "wall_s")) and value <= 0:
            raise ConfigError(f"{key}: must be a positive number of seconds, got {value:g} "
                              f"(default {_get(Config(), key):g}); a limit of 0 or less fails everything at once")
        if value < 0:
            raise ConfigError(f"{key}: must be 0 or more seconds, got {value:g} (default {_get(Config(), key):g})")


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def _validate_paths(cfg: Config) -> None:
    """run.dir must be a writable folder (or creatable in one); resume must exist."""
    run_dir = cfg.run_dir
    found = _nearest_existing(run_dir)
    if not os.path.isdir(found):
        what = "exists and is not a folder" if found == os.path.abspath(run_dir) else f"is under {found!r}, a file"
        raise ConfigError(f"run.dir: {run_dir!r} {what}; set run.dir to a folder path")
    if not os.access(found, os.W_OK | os.X_OK):
        raise ConfigError(f"run.dir: {found!r} is not writable; set run.dir to a folder you can write")
    if cfg.resume in ("auto", "never"):
        return
    if not cfg.resume:
        raise ConfigError("resume: use auto, never, or a checkpoint path")
    if not os.path.exists(cfg.resume):
        raise ConfigError(f"resume: no checkpoint or run folder at {cfg.resume!r}; use auto, never, "
                          "or an existing run_dir/checkpoints/step_<N> path")


_MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _validate_env_name(name: str) -> None:
    """env.name: a shipped name or a module path; whether it imports is checked by aflow_rl.envs.load_env."""
    if not _MODULE_PATH.fullmatch(name):
        raise ConfigError(f"env.name: expected swarm | plan_act | aflow or a dotted module path such as "
                          f"my_pkg.my_env, got {name!r}")


def _validate_task_mix(sw: SwarmEnvConfig) -> None:
    """env.swarm.mix / curriculum / item_range / items_ramp_steps: a curriculum that can run."""
    suites = typing.get_args(typing.get_type_hints(SwarmEnvConfig)["suite"])
    bad = [s for s in sw.mix if s not in suites]
    if bad:
        raise ConfigError(f"env.swarm.mix: unknown suite(s) {bad}; choose from {', '.join(suites)}")
    if sw.curriculum:
        if len(sw.curriculum) != len(sw.mix):
            raise ConfigError(f"env.swarm.curriculum: one start step per suite of env.swarm.mix "
                              f"({len(sw.mix)}), got {len(sw.curriculum)}")
        if sw.curriculum[0] != 0 or any(b < a for a, b in zip(sw.curriculum, sw.curriculum[1:])):
            raise ConfigError(f"env.swarm.curriculum: start steps must begin at 0 and never decrease, got {sw.curriculum}")
    for suite, rng in sw.item_range.items():
        if suite not in suites:
            raise ConfigError(f"env.swarm.item_range: unknown suite {suite!r}; choose from {', '.join(suites)}")
        if (not isinstance(rng, list) or len(rng) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                   for x in rng) or not 1 <= rng[0] <= rng[1]):
            raise ConfigError(f"env.swarm.item_range.{suite}: expected [min, max] integers with 1 <= min <= max, got {rng!r}")
    if sw.items_ramp_steps < 0:
        raise ConfigError(f"env.swarm.items_ramp_steps: must be >= 0, got {sw.items_ramp_steps}")
    if sw.spawn_n == "width" and not (sw.task_schema and sw.effective_actions and sw.no_duplicate_work):
        raise ConfigError("env.swarm.spawn_n=width narrows the spawns of the per-state grammar: set "
                          "env.swarm.task_schema=true effective_actions=true no_duplicate_work=true, or spawn_n=choose")
    if not sw.delegate_ops and not (sw.task_schema and sw.effective_actions):
        raise ConfigError("env.swarm.delegate_ops=false narrows the spawns of the per-state grammar: set "
                          "env.swarm.task_schema=true effective_actions=true, or delegate_ops=true")
    if sw.spawn_profile != "choose" and not sw.task_schema:
        raise ConfigError(f"env.swarm.spawn_profile={sw.spawn_profile} is enforced by the per-state grammar: set "
                          "env.swarm.task_schema=true, or spawn_profile=choose")


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------

def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_resolved(cfg: Config, path: str | None = None) -> str:
    """Write the resolved config (secrets redacted) as YAML; return its path."""
    path = path or os.path.join(cfg.run_dir, "config.yaml")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        yaml.safe_dump(redact(to_dict(cfg)), fh, sort_keys=False)
    return path


def format_help(cls: type = Config, prefix: str = "") -> str:
    """One line per key: name, type, default, help."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"\n[{prefix}{f.name}]  {f.metadata.get('help', '')}")
            lines.append(format_help(tp, prefix + f.name + "."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {prefix + f.name:<42} {_type_name(tp):<28} = {default!r:<14}  {f.metadata.get('help', '')}")
    return "\n".join(lines)
