"""Task mixtures and the curriculum (env.swarm.mix, curriculum, item_range, items_ramp_steps)."""
from collections import Counter

import pytest

from aflow_rl.config import ConfigError, load_config
from aflow_rl.envs.swarm.tasks import curriculum_stage, make_tasks
from aflow_rl.rollout.sampler import TaskSampler

CURRICULUM = ["env.swarm.mix=[wide, deep, mixed]", "env.swarm.curriculum=[0, 10, 20]",
              "env.swarm.item_range={wide: [6, 10], deep: [3, 6], mixed: [4, 8]}", "rollout.tasks_per_step=4"]


def test_stages_follow_the_schedule():
    sw = load_config(None, CURRICULUM).env.swarm
    assert curriculum_stage(sw, 0) == [("wide", 6, 10)]
    assert curriculum_stage(sw, 9) == [("wide", 6, 10)]
    assert curriculum_stage(sw, 10) == [("wide", 6, 10), ("deep", 3, 6)]
    assert curriculum_stage(sw, 25) == [("wide", 6, 10), ("deep", 3, 6), ("mixed", 4, 8)]
    assert curriculum_stage(sw, None) == curriculum_stage(sw, 25)       # evaluation: everything


def test_item_counts_ramp_from_each_suites_join_step():
    sw = load_config(None, CURRICULUM + ["env.swarm.items_ramp_steps=8"]).env.swarm
    # wide joins at 0: max grows 6 + int(4 * (step + 1) / 8)
    assert [curriculum_stage(sw, s)[0][2] for s in (0, 1, 3, 7, 30)] == [6, 7, 8, 10, 10]
    # deep joins at 10: at its first step 3 + int(3 * 1/8) = 3, full (6) from step 17
    assert curriculum_stage(sw, 10)[1] == ("deep", 3, 3) and curriculum_stage(sw, 17)[1] == ("deep", 3, 6)


def test_make_tasks_draws_the_stage_of_the_samplers_position():
    cfg = load_config(None, CURRICULUM)
    early = make_tasks(cfg, 40, seed=3, position=0)               # step 0: wide only
    assert {t["suite"] for t in early} == {"wide"} and all(6 <= len(t["items"]) <= 10 for t in early)
    late = make_tasks(cfg, 300, seed=3, position=4 * 20)          # step 20: all three, about a third each
    counts = Counter(t["suite"] for t in late)
    assert set(counts) == {"wide", "deep", "mixed"} and min(counts.values()) > 70
    for t in late:
        lo, hi = {"wide": (6, 10), "deep": (3, 6), "mixed": (4, 8)}[t["suite"]]
        assert lo <= len(t["items"]) <= hi
    assert make_tasks(cfg, 5, seed=3, position=80) == make_tasks(cfg, 5, seed=3, position=80)


def test_one_suite_without_curriculum_draws_the_same_tasks_as_before():
    cfg = load_config(None, ["env.swarm.suite=deep", "env.swarm.min_items=3", "env.swarm.max_items=5"])
    assert make_tasks(cfg, 6, seed=9) == make_tasks(cfg, 6, seed=9, position=123)
    assert [t["task_id"] for t in make_tasks(cfg, 2, seed=9)] == ["deep-9-0", "deep-9-1"]


def test_sampler_passes_its_position_and_resumes_on_the_curriculum():
    cfg = load_config(None, CURRICULUM)
    a = TaskSampler(make_tasks, cfg, seed=0)
    first = [a.next(4) for _ in range(12)]                          # steps 0..11
    assert {t["suite"] for batch in first[:10] for t in batch} == {"wide"}
    assert "deep" in {t["suite"] for batch in first[10:] for t in batch}
    b = TaskSampler(make_tasks, cfg, seed=0)
    b.load_state_dict({"seed": 0, "position": 40})
    assert b.next(4) == first[10]
    seen = []
    TaskSampler(lambda c, n, s: seen.append((n, s)) or [{}] * n, cfg, seed=0).next(2)   # old 3-arg factories
    assert seen == [(2, 0)]


@pytest.mark.parametrize("bad, match", [
    (["env.swarm.mix=[wide, deep]", "env.swarm.curriculum=[0]"], "one start step per suite"),
    (["env.swarm.mix=[wide, deep]", "env.swarm.curriculum=[5, 10]"], "begin at 0"),
    (["env.swarm.mix=[wide, deep]", "env.swarm.curriculum=[0, 10, 5]"], "one start step"),
    (["env.swarm.mix=[wide, tall]"], "unknown suite"),
    (["env.swarm.item_range={wide: [6]}"], r"\[min, max\]"),
    (["env.swarm.item_range={wide: [6, 2]}"], r"\[min, max\]"),
    (["env.swarm.item_range={tall: [1, 2]}"], "unknown suite"),
    (["env.swarm.items_ramp_steps=-1"], ">= 0"),
])
def test_bad_curricula_are_config_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, bad)


def test_a_balanced_draw_gives_every_step_each_suite_equally_often():
    """env.swarm.draw=balanced: round-robin over the sampler's position, so 6 tasks a step are 2 of each
    suite at every step (a random draw gives some steps 4 deep tasks of 6), resumable like the random one."""
    mix = ["env.swarm.mix=[wide, deep, mixed]", "rollout.tasks_per_step=6"]
    balanced = load_config(None, mix + ["env.swarm.draw=balanced"])
    sampler = TaskSampler(make_tasks, balanced, seed=4)
    for _ in range(20):
        assert Counter(t["suite"] for t in sampler.next(6)) == {"wide": 2, "deep": 2, "mixed": 2}
    resumed = TaskSampler(make_tasks, balanced, seed=4)
    resumed.load_state_dict({"seed": 4, "position": 60})
    assert resumed.next(6) == TaskSampler(make_tasks, balanced, seed=4, position=60).next(6)
    # the random draw is unbalanced at some step of the same 20, and an evaluation set (no position) stays random
    random_cfg = load_config(None, mix)
    rnd = TaskSampler(make_tasks, random_cfg, seed=4)
    assert any(max(Counter(t["suite"] for t in rnd.next(6)).values()) > 2 for _ in range(20))
    assert make_tasks(balanced, 30, seed=4) == make_tasks(random_cfg, 30, seed=4)
    # joining suites mid-curriculum: the draw balances over the suites of the current stage
    staged = load_config(None, mix + ["env.swarm.draw=balanced", "env.swarm.curriculum=[0, 0, 5]"])
    assert Counter(t["suite"] for t in make_tasks(staged, 6, seed=1, position=0)) == {"wide": 3, "deep": 3}
    assert Counter(t["suite"] for t in make_tasks(staged, 6, seed=1, position=30)) == {"wide": 2, "deep": 2, "mixed": 2}
