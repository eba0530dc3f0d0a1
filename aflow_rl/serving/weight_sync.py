"""Weight sync: trainer -> policy servers, verified.

After the trainer writes a Hugging Face directory, every policy server loads
it with ``/update_weights_from_disk`` (SGLang's route; the embedded server
speaks it too); with ``trainer.sync=distributed`` the weights travel over a
torch.distributed group instead (aflow_rl/trainer/dist_sync.py). Either way a
sync is only done when each server

1. answered ``success: true``,
2. reports the new ``weight_version`` on a probe generation, and
3. gives the probe prompt the logprobs the trainer's own weights give
   (``expected_logprobs``), within ``tol``.

Anything else raises ``WeightSyncError``: a silently stale policy would make
every later PPO ratio wrong without any visible symptom.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np

from aflow_rl.llm.base import LLMError
from aflow_rl.llm.sglang import SGLangClient


class WeightSyncError(RuntimeError):
    """A policy server did not end up serving the new weights."""


async def probe_server(client: SGLangClient, url: str, probe_ids: list[int]) -> tuple[str | None, np.ndarray]:
    """One prefill-style request to ``url``: (weight_version, prompt logprobs [P-1])."""
    payload = {"input_ids": [int(t) for t in probe_ids], "return_logprob": True, "logprob_start_len": 0,
               "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    resp = await client.http.request("POST", "/generate", json=payload, url=url)
    reply = resp.json()
    if isinstance(reply, list):
        reply = reply[0]
    meta = reply.get("meta_info", {})
    # SGLang's first prompt position has no logprob (null): nothing predicts it.
    rows = [r for r in meta.get("input_token_logprobs") or [] if r and r[0] is not None]
    version = meta.get("weight_version")
    return (None if version is None else str(version)), np.asarray([r[0] for r in rows], dtype=np.float64)


async def sync_weights(client: SGLangClient, model_dir: str, version: int, *, probe_ids: list[int],
                       expected_logprobs: np.ndarray | None = None, tol: float = 1e-2,
                       timeout_s: float = 120.0) -> dict:
    """Load ``model_dir`` on every server of ``client`` as ``version``; verify; return timings.

    ``expected_logprobs`` [P-1]: the trainer's logprobs of ``probe_ids[1:]``
    given their prefixes (temperature 1, no grammar). ``tol`` bounds the mean
    absolute difference (fp32 servers agree to ~1e-5; bf16 ones to ~1e-2).
    """
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(client.update_weights_from_disk(model_dir, weight_version=str(version)),
                               timeout=timeout_s)
    except asyncio.TimeoutError:
        raise WeightSyncError(f"update_weights_from_disk({model_dir}) did not finish within {timeout_s:.0f} s "
                              f"on {client.urls} (raise trainer.sync_timeout_s for large models)") from None
    except LLMError as exc:
        raise WeightSyncError(f"weight sync to version {version} rejected: {exc}") from None
    t_update = time.monotonic() - t0
    mismatch = await verify_servers(client, version, probe_ids=probe_ids, expected_logprobs=expected_logprobs,
                                    tol=tol, timeout_s=timeout_s)
    return {"update_s": t_update, "total_s": time.monotonic() - t0, "probe_mismatch": mismatch}


async def verify_servers(client: SGLangClient, version: int, *, probe_ids: list[int],
                         expected_logprobs: np.ndarray | None = None, tol: float = 1e-2,
                         timeout_s: float = 120.0) -> float:
    """Checks 2 and 3 above on every server of ``client`` (after either sync method); returns
    the largest mean |Δ logprob| on the probe."""
    mismatch = 0.0
    for url in client.urls:
        try:
            served, logprobs = await asyncio.wait_for(probe_server(client, url, probe_ids), timeout=timeout_s)
        except (asyncio.TimeoutError, LLMError, ValueError) as exc:
            raise WeightSyncError(f"probe of {url} after weight sync failed: {exc!r}") from None
        if served != str(version):
            raise WeightSyncError(f"{url} reports weight_version {served!r} after loading version {version}: "
                                  "the server is serving stale weights")
        if expected_logprobs is not None:
            if logprobs.shape != np.shape(expected_logprobs):
                raise WeightSyncError(f"probe of {url}: {logprobs.shape[0]} prompt logprobs, "
                                      f"expected {np.shape(expected_logprobs)[0]}")
            diff = float(np.mean(np.abs(logprobs - np.asarray(expected_logprobs))))
            if diff > tol:
                raise WeightSyncError(f"{url} serves weights that disagree with the trainer's "
                                      f"(mean |Δ logprob| {diff:.3g} > {tol:g} on the probe prompt)")
            mismatch = max(mismatch, diff)
    return mismatch
