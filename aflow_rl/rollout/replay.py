"""Read step traces back: a summary, episodes turn by turn, or transitions for policy datasets.

    python -m aflow_rl.rollout.replay runs/x/traces                      # summary: files, episodes, returns
    python -m aflow_rl.rollout.replay runs/x/traces --list               # one line per episode attempt
    python -m aflow_rl.rollout.replay runs/x/traces --episode g3/1       # one episode, turn by turn
    python -m aflow_rl.rollout.replay runs/x/traces --all                # every episode, turn by turn
    python -m aflow_rl.rollout.replay runs/x/traces --export out.jsonl   # (obs, action, reward, next_obs)

Paths are trace .jsonl files or folders of them. An episode's attempts
(retries) are kept apart. A line cut short by a killed worker is skipped and
counted.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any, Iterable

Key = tuple[str, Any]  # (episode_id, attempt)


def read_events(paths: Iterable[str]) -> tuple[list[dict], int]:
    """Events from trace files or folders of them, and how many lines were unreadable."""
    events, bad = [], 0
    for path in _trace_files(paths):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    bad += 1
                    continue
                if isinstance(rec, dict) and "episode_id" in rec and "step" in rec:
                    events.append(rec)
                else:
                    bad += 1
    return events, bad


def _trace_files(paths: Iterable[str]) -> list[str]:
    files: list[str] = []
    for p in paths:
        files += sorted(glob.glob(os.path.join(p, "*.jsonl"))) if os.path.isdir(p) else [p]
    return files


def episodes(events: Iterable[dict]) -> dict[Key, list[dict]]:
    """Group events by (episode_id, attempt), each in step order; episodes in order of first event."""
    out: dict[Key, list[dict]] = {}
    for rec in sorted(events, key=lambda r: r.get("ts", 0.0)):
        out.setdefault((str(rec["episode_id"]), rec.get("attempt")), []).append(rec)
    for steps in out.values():
        steps.sort(key=lambda r: (r["step"], r.get("ts", 0.0)))
    return out


def transitions(steps: list[dict]) -> list[dict]:
    """One (obs, action, reward, next_obs) row per step; the last step has next_obs None and done True."""
    rows = []
    for i, rec in enumerate(steps):
        last = i == len(steps) - 1
        rows.append({
            "episode_id": rec["episode_id"], "group_id": rec.get("group_id"), "attempt": rec.get("attempt"),
            "step": rec["step"], "obs": rec.get("observation"), "action": rec.get("action"),
            "reward": rec.get("reward"), "next_obs": None if last else steps[i + 1].get("observation"),
            "done": bool(rec.get("done", last)), "outcome": rec.get("outcome"),
        })
    return rows


def _show(value: Any, width: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if len(text) > width:
        text = text[:width] + f" ... (+{len(text) - width} chars)"
    return text.replace("\n", "\n" + " " * 16)


def format_episode(key: Key, steps: list[dict], width: int = 400) -> str:
    """A readable account of one attempt of one episode."""
    eid, attempt = key
    rewards = [r["reward"] for r in steps if r.get("reward") is not None]
    head = f"== episode {eid}"
    if attempt is not None:
        head += f"  attempt {attempt}"
    if steps and steps[0].get("group_id") is not None:
        head += f"  group {steps[0]['group_id']}"
    head += f"  steps {len(steps)}  return {sum(rewards):.4g}"
    lines = [head]
    for rec in steps:
        timings = rec.get("timings") or {}
        shown = ", ".join(f"{k} {v:.1f}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in timings.items())
        lines.append(f"-- step {rec['step']}" + (f"  [{shown}]" if shown else ""))
        for field in ("observation", "action", "outcome", "reward"):
            if rec.get(field) is not None:
                lines.append(f"   {field + ':':<12} {_show(rec[field], width)}")
        extra = {k: v for k, v in rec.items() if k not in _KNOWN}
        if extra:
            lines.append(f"   {'extra:':<12} {_show(extra, width)}")
    return "\n".join(lines)


_KNOWN = {"ts", "episode_id", "group_id", "attempt", "step", "observation", "action", "outcome", "reward", "timings"}


def summary(eps: dict[Key, list[dict]], files: int, bad: int) -> str:
    """A few lines about a set of traces: what is there and how to look closer."""
    if not eps:
        return f"{files} trace file(s), no episode events"
    steps = [len(v) for v in eps.values()]
    returns = [sum(r["reward"] for r in v if r.get("reward") is not None) for v in eps.values()]
    ids = sorted({k[0] for k in eps})
    retried = sum(1 for k in eps if k[1] not in (None, 1))
    lines = [f"{files} trace file(s), {sum(steps)} step events, {len(eps)} episode attempts of {len(ids)} episodes"
             + (f" ({retried} retries)" if retried else "") + (f", {bad} unreadable line(s)" if bad else ""),
             f"steps per attempt: mean {sum(steps) / len(steps):.1f}, max {max(steps)}; "
             f"return: mean {sum(returns) / len(returns):.4g}, min {min(returns):.4g}, max {max(returns):.4g}",
             f"episodes: {', '.join(ids[:8])}" + (f" ... (+{len(ids) - 8})" if len(ids) > 8 else ""),
             "more: --list (one line per attempt), --episode ID (turn by turn), --all, --export OUT.jsonl"]
    return "\n".join(lines)


def listing(eps: dict[Key, list[dict]]) -> str:
    """One line per episode attempt: id, attempt, group, steps, return."""
    return "\n".join(format_episode(k, v).splitlines()[0] for k, v in eps.items())


def _missing(paths: list[str]) -> str | None:
    for p in paths:
        if not os.path.exists(p):
            return f"no trace file or folder at {p} (a run writes them to run_dir/traces)"
        if os.path.isdir(p) and not glob.glob(os.path.join(p, "*.jsonl")):
            return f"no trace files (*.jsonl) in {p}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aflow_rl.rollout.replay", description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", help="trace .jsonl files, or folders of them (run_dir/traces)")
    show = ap.add_mutually_exclusive_group()
    show.add_argument("--episode", help="only this episode_id (all its attempts), turn by turn")
    show.add_argument("--list", action="store_true", help="one line per episode attempt")
    show.add_argument("--all", action="store_true", help="every episode, turn by turn (long)")
    show.add_argument("--export", metavar="OUT.jsonl", help="write (obs, action, reward, next_obs) rows instead of printing")
    ap.add_argument("--width", type=int, default=400, help="longest value printed before it is cut")
    args = ap.parse_args(argv)

    problem = _missing(args.traces)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    events, bad = read_events(args.traces)
    eps = episodes(events)
    if args.episode is not None:
        eps = {k: v for k, v in eps.items() if k[0] == args.episode}
        if not eps:
            known = sorted({k[0] for k in episodes(events)})
            print(f"episode {args.episode!r} is not in the trace; episodes: {', '.join(known[:20]) or 'none'}"
                  + (" ..." if len(known) > 20 else ""), file=sys.stderr)
            return 1
    if bad and (args.episode is not None or args.all or args.export):
        print(f"(skipped {bad} unreadable line(s): a worker killed mid-write leaves at most one per file)",
              file=sys.stderr)
    if args.export:
        rows = [row for steps in eps.values() for row in transitions(steps)]
        os.makedirs(os.path.dirname(os.path.abspath(args.export)), exist_ok=True)
        with open(args.export, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"wrote {len(rows)} transitions from {len(eps)} episode attempts to {args.export}")
    elif args.episode is not None or args.all:
        print("\n\n".join(format_episode(k, v, args.width) for k, v in eps.items()))
    elif args.list:
        print(listing(eps))
    else:
        print(summary(eps, len(_trace_files(args.traces)), bad))
    return 0


if __name__ == "__main__":
    sys.exit(main())
