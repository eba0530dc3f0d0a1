"""A worker module that cannot be imported: the pool must stop at start-up and name it."""
import aflow_rl_no_such_dependency  # noqa: F401


async def run_episode(task, ctx):
    raise AssertionError("never imported")
