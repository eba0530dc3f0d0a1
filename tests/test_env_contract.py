"""The worker module contract (docs/architecture.md, "Worker modules"), for every shipped environment.

Each name in ``aflow_rl.envs.ENVIRONMENTS`` goes through ``load_env -> make_tasks -> init_worker ->
run_episode`` on the tiny model behind one embedded server (it plays both the policy and the actor role),
and must hand back a valid Trajectory. Then the loader's errors: an unknown name, a module that fails to
import, a module missing a contract function, and the removed keys that used to pick an environment.
"""
import asyncio
import json
import math
import os
import textwrap

import numpy as np
import pytest

from aflow_rl.config import ConfigError, load_config
from aflow_rl.envs import CONTRACT, ENVIRONMENTS, load_env
from aflow_rl.rollout.types import REWARD_COMPONENTS, Trajectory, WorkerContext

# Small knobs per environment so that two episodes each stay within seconds on 2 CPU cores.
SMALL = {
    "swarm": ["env.swarm.policy=model", "env.swarm.max_steps=3", "env.max_new_tokens=16",
              "env.swarm.min_items=2", "env.swarm.max_items=2"],
    "plan_act": ["env.plan_act.max_plan_tokens=16", "env.plan_act.max_act_tokens=8", "env.plan_act.max_steps=2",
                 "env.plan_act.timeout_s=60"],
    "aflow": ["env.aflow.dataset=rg:basic_arithmetic", "env.aflow.num_problems=5", "env.aflow.val_ratio=0.4",
              "env.aflow.executor_max_tokens=8", "env.aflow.max_nodes=2", "env.aflow.prompt=compact",
              "env.max_new_tokens=48"],
}


def test_every_shipped_environment_is_covered():
    assert set(SMALL) == set(ENVIRONMENTS) == {"swarm", "plan_act", "aflow"}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from aflow_rl.bench.serving import start_server, stop_server

    log = str(tmp_path_factory.mktemp("server") / "server.log")
    proc, url = start_server(tiny_model_dir, threads=1, log_path=log)
    try:
        yield url, tiny_model_dir
    finally:
        stop_server(proc)


async def _episodes(env, tasks, ctx) -> list:
    try:
        return await asyncio.gather(*(env.run_episode(t, ctx) for t in tasks))
    finally:
        for key in ("policy_client", "actor_client"):
            if key in ctx.state:
                await ctx.state[key].aclose()


def _check_trajectory(traj, task) -> None:
    assert isinstance(traj, Trajectory), type(traj)
    assert traj.status == "ok", traj.error
    assert (traj.episode_id, traj.group_id) == (task["episode_id"], task["group_id"])
    assert math.isfinite(traj.final_reward)
    assert set(REWARD_COMPONENTS) <= set(traj.reward_components)
    assert all(math.isfinite(v) for v in traj.reward_components.values())
    assert traj.turns, "every shipped environment makes at least one trainable turn on a healthy server"
    for turn in traj.turns:
        assert len(turn.prompt_ids) > 0 and len(turn.response_ids) == len(turn.logprobs) > 0
        assert np.all(turn.logprobs <= 0) and np.all(np.isfinite(turn.logprobs))
    json.dumps(traj.to_dict())  # traces and replay write it as JSON


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_shipped_environment_runs_episodes_on_the_tiny_model(name, server, tmp_path):
    url, model_dir = server
    cfg = load_config(None, [f"env.name={name}", f"serving.policy.model_path={model_dir}",
                             f"run.dir={tmp_path}", "rollout.trace=false", *SMALL[name]])
    env = load_env(cfg.env.name)
    assert env.module.__name__ == ENVIRONMENTS[name] and all(callable(getattr(env, f)) for f in CONTRACT)
    tasks = env.make_tasks(cfg, 2, seed=0)
    assert len(tasks) == 2 and all(isinstance(t, dict) for t in tasks)
    assert json.loads(json.dumps(tasks)) == tasks  # tasks cross process (and machine) boundaries as JSON
    tasks = [dict(t, episode_id=f"{name}-{i}#0", group_id=f"{name}-{i}", attempt=1) for i, t in enumerate(tasks)]
    ctx = WorkerContext(config=cfg, urls={"policy": [url], "actor": [url]}, run_dir=str(tmp_path))
    assert env.init_worker(ctx) is None   # a plain function: the pool calls it once per process
    for traj, task in zip(asyncio.run(_episodes(env, tasks, ctx)), tasks):
        _check_trajectory(traj, task)


# -- errors: one line, naming the problem and the fix ---------------------------------------------


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def test_unknown_name_lists_the_shipped_environments():
    with pytest.raises(ConfigError) as exc:
        load_env("swarn")
    msg = _one_line(exc)
    assert "unknown environment 'swarn'" in msg and "swarm | plan_act | aflow" in msg and "module path" in msg


def test_missing_module_path_names_the_missing_package():
    with pytest.raises(ConfigError) as exc:
        load_env("no_such_pkg_xyz.my_env")
    msg = _one_line(exc)
    assert "cannot import worker module 'no_such_pkg_xyz.my_env': no module named 'no_such_pkg_xyz'" in msg


def test_module_that_fails_to_import_gives_its_own_error():
    with pytest.raises(ConfigError) as exc:
        load_env("tests.rollout.broken_worker")
    msg = _one_line(exc)
    assert "cannot import worker module 'tests.rollout.broken_worker': it raised ModuleNotFoundError" in msg
    assert "aflow_rl_no_such_dependency" in msg


def _user_module(tmp_path, monkeypatch, name: str, body: str) -> str:
    """``user_envs_<name>.env``: a user's own worker module, in a package of its own (no import cache hits)."""
    pkg = tmp_path / f"user_envs_{name}"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "env.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"user_envs_{name}.env"


def test_module_missing_contract_functions_names_each(tmp_path, monkeypatch):
    path = _user_module(tmp_path, monkeypatch, "half", """
        async def run_episode(task, ctx):
            raise AssertionError("never run")
    """)
    with pytest.raises(ConfigError) as exc:
        load_env(path)
    msg = _one_line(exc)
    assert "has no make_tasks(cfg, n, seed), init_worker(ctx);" in msg and "docs/architecture.md" in msg
    # The pool needs only the episode function: the same loader, asked for less, accepts it.
    assert load_env(path, need=("run_episode",)).make_tasks is None


def test_contract_attribute_that_is_not_a_function_is_missing(tmp_path, monkeypatch):
    path = _user_module(tmp_path, monkeypatch, "shadowed", """
        make_tasks = [1, 2]
        def init_worker(ctx): pass
        async def run_episode(task, ctx): pass
    """)
    with pytest.raises(ConfigError, match=r"has no make_tasks\(cfg, n, seed\);"):
        load_env(path)


def test_user_module_by_dotted_path_loads(tmp_path, monkeypatch):
    path = _user_module(tmp_path, monkeypatch, "mine", """
        def make_tasks(cfg, n, seed):
            return [{"i": i} for i in range(n)]
        def init_worker(ctx):
            ctx.state["ready"] = True
        async def run_episode(task, ctx):
            raise NotImplementedError
    """)
    cfg = load_config(None, [f"env.name={path}"])
    env = load_env(cfg.env.name)
    assert env.name == path and env.make_tasks(cfg, 3, 0) == [{"i": 0}, {"i": 1}, {"i": 2}]


@pytest.mark.parametrize("override,message", [
    ("rollout.worker=workers.aflow_worker:run_episode", "rollout.worker was removed: set env.name: aflow"),
    ("rollout.worker=workers.swarm_worker:run_episode", "rollout.worker was removed: set env.name: swarm"),
    ("rollout.worker=my_pkg.env:run_episode", "rollout.worker was removed: set env.name: my_pkg.env"),
    ("env.mode=plan_act", "env.mode was removed: set env.name: plan_act"),
    ("env.mode=swarm", "env.mode was removed: set env.name: swarm"),
    ("env.name=workers.aflow:run_episode", "env.name: expected swarm | plan_act | aflow or a dotted module path"),
    ("env.name=my pkg", "env.name: expected swarm | plan_act | aflow or a dotted module path"),
])
def test_removed_and_malformed_keys_name_the_replacement(override, message):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    assert _one_line(exc).startswith(message)


@pytest.mark.parametrize("text,message", [
    ("rollout:\n  worker: workers.aflow_worker:run_episode\n", "rollout.worker was removed: set env.name: aflow"),
    ("rollout:\n  worker:\n", "rollout.worker was removed: set env.name: swarm"),
    ("env:\n  name: swarm\n  mode: plan_act\n", "env.mode was removed: set env.name: plan_act"),
])
def test_an_old_recipe_file_fails_naming_the_replacement(tmp_path, text, message):
    path = tmp_path / "old.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(str(path))
    assert _one_line(exc).startswith(message)


def test_every_shipped_recipe_names_its_environment():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    configs = sorted(f for f in os.listdir(os.path.join(root, "configs")) if f.endswith(".yaml"))
    names = {f: load_config(os.path.join(root, "configs", f)).env.name for f in configs}
    assert set(names.values()) == set(ENVIRONMENTS), names  # each shipped environment has a recipe
    assert names["plan_act.yaml"] == "plan_act" and names["aflow.yaml"] == "aflow"
