"""The one loader of environments: ``env.name`` -> its worker module's contract functions.

An environment is a *worker module* that defines three functions (the contract,
docs/architecture.md "Worker modules"):

    make_tasks(cfg, n, seed) -> list[dict]       # the trainer's task source (JSON-safe dicts)
    init_worker(ctx) -> None                     # once per worker process: clients, tokenizer into ctx.state
    async run_episode(task, ctx) -> Trajectory   # one episode (a plain function is run in a thread)

``env.name`` is a shipped name (``ENVIRONMENTS``: the modules under ``workers/``)
or the dotted module path of a user's own worker module. ``train.py`` loads it for
``make_tasks``; every pool worker loads it again, in its own process, for
``init_worker`` and ``run_episode`` (the name crosses the process boundary as a
string, so a module only has to be importable where the pool runs it).
"""
from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

from aflow_rl.config import ConfigError

# The shipped environments: env.name -> worker module (workers/ is the top-level home of worker modules).
ENVIRONMENTS = {"swarm": "workers.swarm", "plan_act": "workers.plan_act", "aflow": "workers.aflow"}
CONTRACT = ("make_tasks", "init_worker", "run_episode")
_SIGNATURES = {"make_tasks": "make_tasks(cfg, n, seed)", "init_worker": "init_worker(ctx)",
               "run_episode": "run_episode(task, ctx)"}


@dataclass(frozen=True)
class EnvModule:
    """A loaded worker module and its contract functions (None only where the caller did not need one)."""

    name: str
    module: ModuleType
    make_tasks: Callable | None
    init_worker: Callable | None
    run_episode: Callable | None


def module_path(name: str) -> str:
    """The worker module ``env.name`` refers to: a shipped module, or ``name`` itself."""
    return ENVIRONMENTS.get(name, name)


def load_env(name: str, need: tuple[str, ...] = CONTRACT) -> EnvModule:
    """Import the worker module of ``name`` and check that it defines the functions in ``need``.

    Every problem is a one-line ConfigError naming it and the fix: an unknown name,
    a module that fails to import (its own exception line), a missing function.
    """
    path = module_path(name)
    module = _import(name, path)
    missing = [f for f in need if not callable(getattr(module, f, None))]
    if missing:
        where = getattr(module, "__file__", None) or path
        raise ConfigError(f"env.name={name!r}: worker module {path} ({where}) has no "
                          f"{', '.join(_SIGNATURES.get(f, f) for f in missing)}; a worker module defines "
                          f"{', '.join(CONTRACT)} (docs/architecture.md, Worker modules)")
    return EnvModule(name, module, *(getattr(module, f, None) for f in CONTRACT))


def _import(name: str, path: str) -> ModuleType:
    try:
        return importlib.import_module(path)
    except BaseException as exc:  # ImportError, SyntaxError, or whatever the module raises at import
        if isinstance(exc, KeyboardInterrupt):
            raise
        gone = isinstance(exc, ModuleNotFoundError) and exc.name is not None
        if gone and exc.name == path and "." not in path:
            raise ConfigError(f"env.name: unknown environment {name!r}; choose {' | '.join(ENVIRONMENTS)}, "
                              "or the dotted module path of your own worker module (e.g. my_pkg.my_env)") from None
        if gone and (path == exc.name or path.startswith(exc.name + ".")):
            raise ConfigError(f"env.name={name!r}: cannot import worker module {path!r}: no module named "
                              f"{exc.name!r}; install the package that holds it or put it on sys.path "
                              "(pip install -e . installs aflow_rl and workers)") from None
        what = traceback.format_exception_only(type(exc), exc)[-1].strip()
        raise ConfigError(f"env.name={name!r}: cannot import worker module {path!r}: it raised {what} "
                          "at import (fix the module or install what it imports)") from None
