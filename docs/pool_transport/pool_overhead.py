"""Pool overhead, before/after the transport change (issue 11): start-up of 2 workers, no-op episodes, one SIGKILL.

Run from a checkout: PYTHONPATH=$PWD python docs/pool_transport/pool_overhead.py before|after (uses tests/rollout/fake_workers).
"""
import json
import os
import sys
import time

from aflow_rl.config import RolloutConfig
from aflow_rl.rollout.pool import RolloutPool
side = sys.argv[1]
res = {"side": side, "load_1m": os.getloadavg()[0]}
cfg = RolloutConfig(backend="loky", workers=2, concurrency_per_worker=64, episode_timeout_s=30.0, start_timeout_s=120.0)
t0 = time.perf_counter()
with RolloutPool(cfg, env="tests.rollout.fake_workers") as pool:
    res["start_s"] = round(time.perf_counter() - t0, 3)
    list(pool.run([{"seed": i} for i in range(200)]))  # warm-up
    n = 4000
    t0 = time.perf_counter()
    out = list(pool.run([{"seed": i} for i in range(n)]))
    dt = time.perf_counter() - t0
    assert len(out) == n and all(t.ok for t in out)
    res["noop_eps_per_s"] = round(n / dt, 1)
    t0 = time.perf_counter()  # one crash among 64 running: detection + replacement + re-runs
    out = list(pool.run([{"seed": i, "mode": "kill_first" if i == 0 else "sleep", "sleep": 0.3} for i in range(64)]))
    res["crash_recovery_s"] = round(time.perf_counter() - t0, 3)
print(json.dumps(res))
