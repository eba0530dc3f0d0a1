"""Weight sync, disk vs distributed: seconds per GB of weights, trainer to an embedded server.

    python -m aflow_rl.bench.weight_sync [--rounds 6] [--preset small] [--threads 1] [--json OUT] [--smoke]

Builds the ``small`` tiny-model preset (``python -m aflow_rl.models.tiny --preset small``),
starts one embedded policy server on it, and syncs the trainer's fp32 copy of the weights
``rounds`` times by each method, interleaved (disk, distributed, distributed, disk, ...) so
both see the same machine load:

* ``disk``: :func:`aflow_rl.trainer.weights.export_hf` (safetensors + tokenizer, atomic rename)
  then ``/update_weights_from_disk`` -- what ``trainer.sync=disk`` does;
* ``distributed``: :class:`aflow_rl.trainer.dist_sync.DistributedSync` -- the group is created
  once, before the first timed round (as in a run); each round is begin, buckets over gloo, end.

Each timed sync is followed (untimed) by the trainer's verification: the new ``weight_version``
and the probe logprobs equal to the trainer's. Reported: median seconds per sync and per GB of
parameters, the machine, and the 1-minute load average at the start and end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from typing import Optional

import torch

from aflow_rl.bench import machine

PROBE = [5, 6, 7, 8, 9, 10, 11, 12]


def _probe_logprobs(model) -> list[float]:
    with torch.no_grad():
        ids = torch.tensor([PROBE])
        logits = model(input_ids=ids).logits.float()[0, :-1]
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].tolist()


def _nudge(model, step: int) -> None:
    """A small change per round, so every sync carries new weights the probe can tell apart."""
    with torch.no_grad():
        model.model.norm.weight.mul_(1.0 + 0.01 * (step % 3 + 1))


def _timed_round(method: str, model, tokenizer, client, sync, out_dir: str, version: int) -> float:
    from aflow_rl.trainer.weights import export_hf

    t0 = time.perf_counter()
    if method == "disk":
        path = export_hf(model, tokenizer, os.path.join(out_dir, "sync", "policy"))
        asyncio.run(client.update_weights_from_disk(path, weight_version=str(version)))
    else:
        sync.push(model, client, version)
    return time.perf_counter() - t0


def run(rounds: int = 6, preset: str = "small", threads: int = 1, bucket_mb: float = 512.0) -> dict:
    """Start the server, then ``rounds`` interleaved syncs per method; returns the report."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aflow_rl.config import ServerConfig, ServingConfig
    from aflow_rl.llm.sglang import SGLangClient
    from aflow_rl.models.tiny import build
    from aflow_rl.serving.manager import ServerManager
    from aflow_rl.serving.weight_sync import verify_servers
    from aflow_rl.trainer.dist_sync import DistributedSync

    load_start = os.getloadavg()[0]
    times: dict[str, list[float]] = {"disk": [], "distributed": []}
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        model_dir = build(os.path.join(tmp, preset), preset=preset, seed=0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
        serving = ServingConfig(policy=ServerConfig(backend="embedded", model_path=model_dir, threads=threads,
                                                    max_batch_size=4, startup_timeout_s=300.0),
                                actor=ServerConfig(backend="none"))
        with ServerManager(serving, os.path.join(tmp, "run")) as servers:
            client = SGLangClient(servers.urls("policy"), timeout_s=300.0, max_retries=0)
            sync = DistributedSync(bucket_mb=bucket_mb, timeout_s=300.0, group_name="bench_weight_sync")
            t0 = time.perf_counter()
            sync.push(model, client, 0)          # creates the group: once per run, not per sync
            connect_s = time.perf_counter() - t0
            version = 0
            for r in range(rounds):
                for method in (("disk", "distributed") if r % 2 == 0 else ("distributed", "disk")):
                    version += 1
                    _nudge(model, version)
                    times[method].append(_timed_round(method, model, tokenizer, client, sync, tmp, version))
                    asyncio.run(verify_servers(client, version, probe_ids=PROBE,
                                               expected_logprobs=_probe_logprobs(model), tol=1e-4))
            sync.close()
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
           "load_avg_1m_start": round(load_start, 2), "load_avg_1m_end": round(os.getloadavg()[0], 2),
           "preset": preset, "params_gb": gb, "rounds": rounds, "server_threads": threads, "bucket_mb": bucket_mb,
           "distributed_first_sync_s": connect_s}
    for method, ts in times.items():
        out[method] = {"median_s": statistics.median(ts), "s_per_gb": statistics.median(ts) / gb, "per_round_s": ts}
    out["disk_over_distributed"] = out["disk"]["median_s"] / out["distributed"]["median_s"]
    return out


def format_table(rep: dict) -> str:
    m = rep["machine"]
    lines = [f"machine: {m['platform']} | {m['cpu']} | {m['cores']} cores | torch {m['torch']} | {rep['date']} | "
             f"load avg (1 min) {rep['load_avg_1m_start']:.1f} at the start, {rep['load_avg_1m_end']:.1f} at the end",
             f"preset {rep['preset']}: {rep['params_gb'] * 1e3:.1f} MB of fp32 parameters, {rep['rounds']} interleaved "
             f"rounds, server threads {rep['server_threads']}, bucket {rep['bucket_mb']:g} MB", "",
             "| method | median s per sync | s per GB | per round s |", "|---|---:|---:|---|"]
    for method in ("disk", "distributed"):
        r = rep[method]
        per = ", ".join(f"{x:.3f}" for x in r["per_round_s"])
        lines.append(f"| {method} | {r['median_s']:.3f} | {r['s_per_gb']:.2f} | {per} |")
    lines += ["", f"disk / distributed: {rep['disk_over_distributed']:.2f}x; the distributed group's creation "
                  f"(once per run, with the first sync): {rep['distributed_first_sync_s']:.2f} s"]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="timed syncs per method (interleaved)")
    ap.add_argument("--preset", default="small", help="tiny-model preset (aflow_rl.models.tiny)")
    ap.add_argument("--threads", type=int, default=1, help="server torch threads")
    ap.add_argument("--bucket-mb", type=float, default=512.0, help="trainer.sync_bucket_mb")
    ap.add_argument("--smoke", action="store_true", help="1 round on the tiny preset (a quick check that it runs)")
    ap.add_argument("--json", default=None, help="also write the report as JSON here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    rounds, preset = (1, "tiny") if args.smoke else (args.rounds, args.preset)
    report = run(rounds, preset, args.threads, args.bucket_mb)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
