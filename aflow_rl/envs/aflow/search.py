"""Workflow search alone, with a frozen optimizer model, as AFlow runs it.

    python -m aflow_rl.envs.aflow.search configs/aflow.yaml [key=value ...]

Loads the config, the dataset (``env.aflow.dataset``) and its seeded
validation split, starts the servers of ``serving`` (``policy``: the frozen
optimizer model; ``actor``: the executor that runs the workflows), then runs
the optimizer loop (``optimizer.Optimizer``) for ``env.aflow.max_rounds``
rounds or until convergence. Everything goes under ``run_dir/search/``
(results.json, experience.db, workflows/round_<r>/, best.yaml, summary.json);
running the same command again resumes a search that was stopped. The
experience pool there is the one training reads too, so a search can seed a
training run with the same ``run.dir``.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from aflow_rl.config import Config, ConfigError, load_config, save_resolved
from aflow_rl.envs.aflow.optimizer import search_dir


def validation_split(cfg: Config) -> list:
    """The validation problems of ``env.aflow`` (AFlow's seeded 1:4 validation:test split)."""
    from aflow_rl.envs.aflow.datasets import load_dataset, split

    a = cfg.env.aflow
    problems = load_dataset(a.dataset, num_problems=a.num_problems)
    val, _test = split(problems, a.val_ratio, a.split_seed)
    if not val:
        raise ConfigError(f"env.aflow: the validation split of {a.dataset!r} is empty "
                          f"({len(problems)} problems, val_ratio={a.val_ratio}); raise num_problems or val_ratio")
    return val


def load_tokenizer(cfg: Config) -> Any:
    """The policy tokenizer for ``generate_turn`` (sglang provider), else None (chat requests)."""
    if cfg.llm.policy.provider != "sglang":
        return None
    path = cfg.serving.policy.model_path
    if not path:
        raise ConfigError("serving.policy.model_path: the sglang optimizer client needs the model's tokenizer "
                          "(set it to the optimizer model directory)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


async def run_search(cfg: Config, urls: dict[str, list[str]], *, log=None) -> dict:
    """The search loop against servers at ``urls``; returns the summary (also in summary.json)."""
    from aflow_rl.envs.aflow.graph import proposal_schema
    from aflow_rl.envs.aflow.optimizer import (Optimizer, PolicyProposer, initial_workflow, make_evaluate,
                                               question_type)
    from aflow_rl.llm import make_client

    a = cfg.env.aflow
    val = validation_split(cfg)
    kind = question_type(val)
    policy = make_client(cfg.llm.policy, urls.get("policy", []), role="policy")
    actor = make_client(cfg.llm.actor, urls.get("actor", []), role="actor")
    try:
        proposer = PolicyProposer(policy, load_tokenizer(cfg), temperature=cfg.env.temperature,
                                  max_new_tokens=cfg.env.max_new_tokens,
                                  schema=proposal_schema(a))
        opt = Optimizer(a, search_dir(cfg.run_dir), proposer=proposer, evaluate=make_evaluate(a, actor, val),
                        initial=initial_workflow(a, kind), seed=cfg.run.seed, kind=kind, num_problems=len(val),
                        log=log)
        return await opt.run()
    finally:
        await policy.aclose()
        await actor.aclose()


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    path, overrides = (argv[0], argv[1:]) if "=" not in argv[0] else (None, argv)
    try:
        cfg = load_config(path, overrides)
        from aflow_rl.sandbox import configure

        print(configure(cfg.sandbox.allow_unisolated), flush=True)  # the isolation generated code gets
    except ConfigError as exc:  # SandboxRefused too: only basic isolation, not allowed
        sys.exit(f"config error: {exc}")
    from aflow_rl.serving.manager import ServerManager

    out = search_dir(cfg.run_dir)
    os.makedirs(out, exist_ok=True)
    save_resolved(cfg, os.path.join(out, "config.yaml"))
    try:
        with ServerManager(cfg.serving, cfg.run_dir) as servers:
            summary = asyncio.run(run_search(cfg, servers.all_urls()))
    except ConfigError as exc:
        sys.exit(f"config error: {exc}")
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
