"""Asynchronous training (trainer.max_staleness): the driver's admission control, train.py's
rollout with the driver against a real pool (threading backend, fake episodes), the episode
files a resumed run reuses. The end-to-end kill-and-resume run is in tests/test_train_async.py."""
import json
import os
import threading
import time
import types

import numpy as np
import pytest

import train
from aflow_rl.config import RolloutConfig, load_config
from aflow_rl.rollout.pool import RolloutPool
from aflow_rl.rollout.sampler import TaskSampler
from aflow_rl.rollout.types import Trajectory, Turn
from aflow_rl.trainer.async_rollout import AsyncRollout, staleness_stats
from aflow_rl.trainer.episode_files import EpisodeAppender, ResumingPool, episode_path, load_completed
from tests.rollout import fake_workers

FAKE = "tests.rollout.fake_workers"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Server:
    """The policy servers' weight version, as the simulated trainer syncs it."""

    def __init__(self):
        self.version = 0


class StampedPool:
    """A real RolloutPool whose trajectories get the policy version the server had when the run
    STARTED (the oldest a turn of it can carry: the worst case for staleness) and an r_perf that
    varies per task (so advantages are not all zero). ``runs`` records (first episode id, server
    version at start) per run; ``delay_s`` slows every run down (a slow worker)."""

    def __init__(self, pool, server, delay_s=0.0):
        self.pool, self.server, self.delay_s, self.runs, self.yielded = pool, server, delay_s, [], []

    @property
    def stats(self):
        return self.pool.stats

    def run(self, episodes):
        episodes = list(episodes)
        version = self.server.version
        self.runs.append((episodes[0]["episode_id"], version))
        time.sleep(self.delay_s)
        for traj in self.pool.run(episodes):
            for turn in traj.turns:
                turn.policy_version = version
            sample = int(traj.episode_id.rsplit("/", 1)[1])   # the group's members differ by their index
            traj.reward_components = {"r_perf": traj.final_reward + 0.5 * sample}
            self.yielded.append(traj.episode_id)
            yield traj


def real_pool(workers=1, concurrency=1):
    cfg = RolloutConfig(backend="threading", workers=workers, concurrency_per_worker=concurrency,
                        episode_timeout_s=10.0, timeout_grace_s=1.0, max_attempts=2, start_timeout_s=30.0)
    return RolloutPool(cfg, env=FAKE).start()


def services(tmp_path, pool, k, max_steps, *, use_driver):
    """train.Rank0Services with the parts rollout/produce use: a sampler over fake tasks, the pool."""
    cfg = load_config(os.path.join(ROOT, "configs", "test.yaml"),
                      [f"run.dir={tmp_path}", f"trainer.max_staleness={k}", f"trainer.max_steps={max_steps}",
                       "rollout.group_size=2", "rollout.tasks_per_step=2"])
    s = train.Rank0Services(cfg)
    s.sampler, s.pool, s.bar = TaskSampler(fake_workers.make_tasks, cfg, 7), pool, types.SimpleNamespace(write=print)
    if use_driver:
        s.stream = AsyncRollout(s.produce, max_staleness=k, start_step=0, max_steps=max_steps,
                                size=lambda item: len(item[1]), clock=time.perf_counter)
    return s


def train_loop(s, server, max_steps, train_s=0.0):
    """What main() does around the rollout: take step t's batch, 'train', sync, publish."""
    batches = []
    for step in range(max_steps):
        batch = s.rollout(step)
        batches.append((batch, [t.episode_id for t in s._trajs]))
        time.sleep(train_s)
        server.version = step + 1
        s.publish(step + 1)
    return batches


def test_driver_with_k0_gives_the_synchronous_batches(tmp_path):
    """k = 0 through the async driver: the same trajectories in the same order, the same turns and
    advantages, as train.py's synchronous rollout (k = 0 runs the latter)."""
    runs = {}
    for name, use_driver in (("sync", False), ("driver", True)):
        server = Server()
        with real_pool() as pool:    # one worker, one episode at a time: a deterministic order
            stamped = StampedPool(pool, server)
            s = services(tmp_path / name, stamped, 0, 4, use_driver=use_driver)
            runs[name] = train_loop(s, server, 4)
            if s.stream:
                s.stream.close()
    assert len(runs["sync"]) == len(runs["driver"]) == 4
    for (a, ids_a), (b, ids_b) in zip(runs["sync"], runs["driver"]):
        assert ids_a == ids_b and len(ids_a) == 4
        assert len(a.turns) == len(b.turns)
        for ta, tb in zip(a.turns, b.turns):
            assert ta.response_ids.tolist() == tb.response_ids.tolist() and ta.policy_version == tb.policy_version
        np.testing.assert_array_equal(a.advantages, b.advantages)
        assert np.abs(a.advantages).sum() > 0                       # the comparison is not of zeros
        assert {k: v for k, v in a.stats.items() if not k.startswith(("timing/", "async/admission"))} == \
               {k: v for k, v in b.stats.items() if not k.startswith(("timing/", "async/admission"))}
        assert a.stats["async/staleness_max"] == b.stats["async/staleness_max"] == 0.0


@pytest.mark.parametrize("k", [1, 2])
def test_no_trained_turn_older_than_k_and_no_completed_episode_dropped(tmp_path, k):
    """Slow training, fast rollout: the rollout runs ahead, but never more than k steps."""
    server = Server()
    with real_pool(workers=2, concurrency=2) as pool:
        stamped = StampedPool(pool, server)
        s = services(tmp_path, stamped, k, 6, use_driver=True)
        batches = train_loop(s, server, 6, train_s=0.2)
        s.stream.close()
    lags = [step - t.policy_version for step, (b, _) in enumerate(batches) for t in b.turns]
    assert max(lags) == k and min(lags) >= 0                        # the bound is reached, never passed
    assert batches[-1][0].stats["async/staleness_max"] == k
    trained = [eid for _, ids in batches for eid in ids]
    assert sorted(trained) == sorted(stamped.yielded) and len(set(trained)) == len(trained) == 6 * 4
    assert all(ids[0].startswith(f"s{step}-") for step, (_, ids) in enumerate(batches))   # oldest first
    for step in range(6):   # every episode is on disk, in its step's file
        assert len(load_completed(str(tmp_path), step)) == 4


def test_admission_control_holds_under_a_slow_worker(tmp_path):
    """A slow worker: each chunk takes longer than a training step. Every chunk still starts only
    once the server version is within k of the step it is trained in, and the trainer waits."""
    server, k = Server(), 1
    with real_pool() as pool:
        stamped = StampedPool(pool, server, delay_s=0.3)
        s = services(tmp_path, stamped, k, 5, use_driver=True)
        batches = train_loop(s, server, 5, train_s=0.05)
        s.stream.close()
    starts = [(int(first.split("-")[0][1:]), version) for first, version in stamped.runs]
    assert [t for t, _ in starts] == list(range(5))
    assert all(t - v <= k for t, v in starts), starts
    assert any(t - v == k for t, v in starts), starts               # it did run ahead, by k
    assert all(b.stats["async/queue_episodes"] == 0 for b, _ in batches)   # nothing piled up


def test_fast_rollout_waits_for_admission_and_the_queue_holds_at_most_k_chunks():
    published, k = [0], 2
    ready_at_start = []
    log = threading.Lock()

    def produce(t):
        with log:
            ready_at_start.append((t, published[0]))
        return list(range(3))                                        # three "episodes"

    stream = AsyncRollout(produce, max_staleness=k, start_step=0, max_steps=6, size=len).start()
    infos = []
    for step in range(6):
        time.sleep(0.05)                                             # the rollout thread runs ahead meanwhile
        item, info = stream.take(step)
        infos.append(info)
        time.sleep(0.05)
        published[0] = step + 1
        stream.publish(step + 1)
    stream.close()
    assert all(t - v <= k for t, v in ready_at_start), ready_at_start
    assert max(i["queue_episodes"] for i in infos) == k * 3         # at most k later chunks wait, complete
    assert max(i["admission_wait_s"] for i in infos) > 0.03          # chunks waited to be admitted


def test_rollout_thread_error_reaches_the_trainer_and_close_never_hangs():
    def produce(t):
        if t == 1:
            raise train.RunFailed("step 2 cannot learn: every episode failed")
        return []

    stream = AsyncRollout(produce, max_staleness=1, start_step=0, max_steps=4).start()
    assert stream.take(0)[0] == []
    with pytest.raises(train.RunFailed, match="step 2 cannot learn"):
        stream.take(1)
    stream.close()
    idle = AsyncRollout(lambda t: [], max_staleness=1, start_step=3, max_steps=4).start()
    idle.take(3)
    with pytest.raises(RuntimeError, match="step 4 was never produced"):
        idle.take(4)
    t0 = time.monotonic()
    blocked = AsyncRollout(lambda t: [], max_staleness=1, start_step=0, max_steps=10).start()
    time.sleep(0.1)   # chunks 0 and 1 done, the thread waits for admission of chunk 2
    blocked.close()
    assert time.monotonic() - t0 < 2 and not blocked._thread.is_alive()
    with pytest.raises(ValueError, match="max_staleness must be at least 0"):
        AsyncRollout(lambda t: [], max_staleness=-1, start_step=0, max_steps=1)


def test_overlap_counts_only_time_a_chunk_ran():
    now = [0.0]
    started, gate = threading.Event(), threading.Event()

    def produce(t):
        started.set()
        gate.wait(5)
        now[0] = 4.0
        return []

    stream = AsyncRollout(produce, max_staleness=1, start_step=0, max_steps=1, clock=lambda: now[0]).start()
    started.wait(5)
    now[0] = 2.0   # a chunk running since clock 0.0 (a start at 0 is a start, not "none running")
    assert stream.overlap_s(1.0, 3.0) == pytest.approx(1.0)          # running since 0, clock at 2
    gate.set()
    stream.take(0)
    assert stream.overlap_s(-2.0, 10.0) == pytest.approx(4.0)        # the span 0..4
    assert stream.overlap_s(3.0, 10.0) == pytest.approx(1.0)
    assert stream.overlap_s(5.0, 10.0) == 0.0
    stream.close()


def test_staleness_stats_are_the_lag_of_each_turn():
    turns = [Turn([1], [2], [-0.1], policy_version=v) for v in (3, 5, 5, 4)]
    assert staleness_stats(turns, 5) == {"async/staleness_mean": 0.75, "async/staleness_max": 2.0}
    assert staleness_stats([], 5) == {"async/staleness_mean": 0.0, "async/staleness_max": 0.0}


def _traj(eid, status="ok"):
    return Trajectory(episode_id=eid, group_id=eid.split("/")[0], status=status,
                      turns=[Turn([1, 2], [3], [-0.2])] if status == "ok" else [])


def test_episode_files_reuse_what_completed_and_run_only_the_rest(tmp_path):
    save = EpisodeAppender(str(tmp_path), 3)
    for traj in (_traj("g0/0", "failed"), _traj("g0/1"), _traj("g0/0")):   # g0/0 retried: the last line wins
        save(traj)
    with open(episode_path(str(tmp_path), 3), "a") as fh:
        fh.write('{"episode_id": "g1/0", "group_id": "g1", "tur')      # cut short by a kill
    done = load_completed(str(tmp_path), 3)
    assert sorted(done) == ["g0/0", "g0/1"] and done["g0/0"].ok
    EpisodeAppender(str(tmp_path), 3)(_traj("g1/0"))                   # after the cut line, not glued to it
    assert sorted(load_completed(str(tmp_path), 3)) == ["g0/0", "g0/1", "g1/0"]
    assert load_completed(str(tmp_path), 4) == {}

    class Pool:   # the public API only
        stats = {"pool/retries": 1.0}

        def __init__(self):
            self.ran = []

        def run(self, episodes):
            for e in episodes:
                self.ran.append(e["episode_id"])
                yield _traj(e["episode_id"])

    inner, saved = Pool(), []
    pool = ResumingPool(inner, done, saved.append)
    episodes = [{"episode_id": f"g{g}/{j}", "group_id": f"g{g}"} for g in range(2) for j in range(2)]
    got = [t.episode_id for t in pool.run(episodes)]
    assert sorted(got) == ["g0/0", "g0/1", "g1/0", "g1/1"] and inner.ran == ["g1/0", "g1/1"]
    assert [t.episode_id for t in saved] == ["g1/0", "g1/1"] and pool.stats == {"pool/retries": 1.0}
    assert [t.episode_id for t in pool.run(episodes)] == ["g0/0", "g0/1", "g1/0", "g1/1"]   # a retry runs all


def test_async_sampler_state_is_the_position_before_the_step(tmp_path):
    with real_pool() as pool:
        server = Server()
        s = services(tmp_path, StampedPool(pool, server), 2, 3, use_driver=True)
        s._start_position, s._start_step = 10, 1
        s.sampler.position = 16   # the rollout thread has drawn ahead
        assert s.sampler_state(2)["position"] == 12 and s.sampler_state(2)["seed"] == 7
        s.stream = None
        assert s.sampler_state(2)["position"] == 16   # synchronous: the sampler itself


def test_every_config_loads_with_max_staleness():
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        cfg = load_config(os.path.join(ROOT, "configs", name), ["trainer.max_staleness=1"])
        assert cfg.trainer.max_staleness == 1
    with pytest.raises(Exception, match="trainer.max_staleness: must be at least 0"):
        load_config(os.path.join(ROOT, "configs", "test.yaml"), ["trainer.max_staleness=-1"])
    assert json.dumps(load_config(os.path.join(ROOT, "configs", "test.yaml")).trainer.max_staleness) == "0"
