"""Trainer test fixtures: one process group for the whole session (DeepSpeed keeps a
global communicator, so it is set up once and never torn down mid-session)."""
import pytest


@pytest.fixture(scope="session")
def dist_info():
    from aflow_rl.trainer.learner import setup_distributed

    return setup_distributed()
