"""What every worker module's ``init_worker`` builds: a client per server role, the policy tokenizer."""
from __future__ import annotations

from typing import Any

from aflow_rl.rollout.types import WorkerContext


def role_client(ctx: WorkerContext, role: str) -> Any:
    """The inference client of ``role`` (policy | actor): ``llm.<role>`` against ``ctx.urls[role]``."""
    from aflow_rl.llm import make_client  # httpx and the providers load only where a server is used

    return make_client(getattr(ctx.config.llm, role), list(ctx.urls.get(role, [])), role=role)


def policy_tokenizer(cfg: Any, who: str) -> Any:
    """The tokenizer of ``serving.policy.model_path``: trainable turns are token ids, not text."""
    path = cfg.serving.policy.model_path
    if not path:
        raise ValueError(f"serving.policy.model_path: {who} needs its tokenizer (set it to the policy model directory)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
