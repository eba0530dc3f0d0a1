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

Two ways to load (``inflight``, the config key ``trainer.sync_inflight``):

- ``False``: a plain update. SGLang (and the embedded server) first let every
  running request finish, holding new ones, so each reply comes from one version.
- ``True``: SGLang's in-flight flow, ``/pause_generation {"mode": pause_mode}`` ->
  ``/update_weights_from_disk`` -> ``/continue_generation``. The update does not
  wait for running requests; with ``in_place`` they keep their KV and finish
  under the new weights, reporting the new ``weight_version``. ``continue`` is
  sent on every path, failures and timeouts included, so no server stays paused.
"""
from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from aflow_rl.llm.base import LLMError
from aflow_rl.llm.sglang import SGLangClient

_log = logging.getLogger(__name__)

# Of timeout_s, the part kept for /continue_generation: a hung update must not leave no time to resume.
CONTINUE_SHARE, CONTINUE_MAX_S = 0.25, 10.0


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


async def _update(client: SGLangClient, model_dir: str, version: int, timeout_s: float) -> None:
    """``update_weights_from_disk`` on every server within ``timeout_s``; WeightSyncError otherwise."""
    try:
        await asyncio.wait_for(client.update_weights_from_disk(model_dir, weight_version=str(version)),
                               timeout=timeout_s)
    except asyncio.TimeoutError:
        raise WeightSyncError(f"update_weights_from_disk({model_dir}) did not finish within {timeout_s:.0f} s "
                              f"on {client.urls} (raise trainer.sync_timeout_s for large models)") from None
    except LLMError as exc:
        raise WeightSyncError(f"weight sync to version {version} rejected: {exc}") from None


async def _on_servers(client: SGLangClient, call, urls: list[str], timeout_s: float) -> dict[str, str]:
    """``call(urls=[u], timeout_s=...)`` on each of ``urls`` at once, bounded by ``timeout_s``.

    Returns ``{url: error}`` for the servers that answered with an error or did not answer in
    time. A server that cannot be reached at all leaves the rotation with a warning, as a plain
    update treats it (``SGLangClient.update_weights_from_disk``), and is not an error here.
    """
    async def one(url: str) -> str | None:
        try:
            # The HTTP deadline is later than wait_for's: a server that hangs is a timeout here,
            # and an LLMError without a status is one that could not be reached.
            await asyncio.wait_for(call(urls=[url], timeout_s=timeout_s + 1.0), timeout=timeout_s)
        except asyncio.TimeoutError:
            return f"no answer within {timeout_s:.1f} s"
        except LLMError as exc:
            if exc.status is None:
                client.http.mark_down(url)
                _log.warning("weight sync: %s is unreachable (%s); it leaves the rotation", url, exc)
                return None
            return str(exc)
        return None

    errors = await asyncio.gather(*(one(u) for u in urls))
    return {u: e for u, e in zip(urls, errors) if e is not None}


async def _update_in_flight(client: SGLangClient, model_dir: str, version: int, timeout_s: float,
                            pause_mode: str) -> None:
    """pause(pause_mode) -> update -> continue, all within ``timeout_s``; continue on every path."""
    if pause_mode not in SGLangClient.PAUSE_MODES:
        raise WeightSyncError(f"pause mode {pause_mode!r} is not one of {SGLangClient.PAUSE_MODES} "
                              f"(trainer.sync_pause_mode)")
    deadline = time.monotonic() + timeout_s
    reserve = min(CONTINUE_MAX_S, timeout_s * CONTINUE_SHARE)
    paused = list(client.urls)
    error: BaseException | None = None
    try:
        failed = await _on_servers(client, lambda **kw: client.pause_generation(pause_mode, **kw), paused,
                                   timeout_s - reserve)
        if failed:
            raise WeightSyncError(f"pause_generation(mode={pause_mode}) failed before the weight sync to version "
                                  f"{version}: {failed} (a server without SGLang's pause routes needs "
                                  f"trainer.sync_inflight: false)")
        await _update(client, model_dir, version, max(deadline - reserve - time.monotonic(), 1e-3))
    except BaseException as exc:    # cancellation too: a server must not stay paused
        error = exc
    targets = list(dict.fromkeys(paused + client.urls))    # a server back in rotation now was paused too
    failed = await _on_servers(client, client.continue_generation, targets,
                               max(deadline - time.monotonic(), 1e-3))
    if failed:
        before = f"; the sync had failed already: {error}" if error is not None else ""
        raise WeightSyncError(f"continue_generation failed after the weight sync to version {version}: {failed}; "
                              f"generation on those servers stays paused{before}") from error
    if error is not None:
        raise error


async def sync_weights(client: SGLangClient, model_dir: str, version: int, *, probe_ids: list[int],
                       expected_logprobs: np.ndarray | None = None, tol: float = 1e-2,
                       timeout_s: float = 120.0, inflight: bool = False, pause_mode: str = "in_place") -> dict:
    """Load ``model_dir`` on every server of ``client`` as ``version``; verify; return timings.

    ``expected_logprobs`` [P-1]: the trainer's logprobs of ``probe_ids[1:]``
    given their prefixes (temperature 1, no grammar). ``tol`` bounds the mean
    absolute difference (fp32 servers agree to ~1e-5; bf16 ones to ~1e-2).
    ``inflight``: update between decode steps without waiting for running requests
    (pause ``pause_mode`` -> update -> continue; see the module docstring).
    """
    t0 = time.monotonic()
    if inflight:
        await _update_in_flight(client, model_dir, version, timeout_s, pause_mode)
    else:
        await _update(client, model_dir, version, timeout_s)
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
