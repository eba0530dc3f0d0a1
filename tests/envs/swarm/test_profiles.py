"""The frozen subagent pool: simulated outcomes follow the profile; LLM subagents run a ReAct loop."""
import asyncio

import pytest

from aflow_rl.envs.swarm.kb import build_kb
from aflow_rl.envs.swarm.llm_subagents import LLMSubagents, subtask_prompt
from aflow_rl.envs.swarm.profiles import PROFILES, SimulatedSubagents, SubagentJob
from aflow_rl.envs.swarm.tasks import generate_task, tool_steps
from aflow_rl.llm.base import LLMError
from tests.envs.swarm.fakes import ScriptedLLM

TASK = generate_task("wide", 0, min_items=3, max_items=3)
ITEM = TASK["items"][0]


def attempts(profile, n=1500):
    sim = SimulatedSubagents(build_kb(0))
    return [asyncio.run(sim.run(SubagentJob(ITEM, {}, PROFILES[profile], seed=s))) for s in range(n)]


@pytest.mark.parametrize("profile", ["small", "medium", "large"])
def test_simulated_outcomes_match_the_profile(profile):
    p = PROFILES[profile]
    res = attempts(profile)
    fail = sum(not r.ok for r in res) / len(res)
    wrong = sum(r.ok and r.answer != TASK["gold"][ITEM["id"]] for r in res) / len(res)
    assert fail == pytest.approx(p.p_fail, abs=0.03) and wrong == pytest.approx(p.p_wrong, abs=0.02)
    k = tool_steps(ITEM)
    for r in res:
        if r.ok:
            assert k + 1 <= r.steps <= k + 1 + p.extra_steps
        assert r.latency_ms == r.steps * p.ms_per_step and r.tokens_in == r.steps * p.tokens_in_per_step


def test_simulated_attempt_is_a_function_of_its_seed():
    sim = SimulatedSubagents(build_kb(0))
    job = SubagentJob(ITEM, {}, PROFILES["small"], seed=123)
    assert asyncio.run(sim.run(job)) == asyncio.run(sim.run(job))


def test_a_wrong_input_is_noticed_when_it_names_no_entity():
    deep = generate_task("deep", 0, min_items=2, max_items=2)
    sim = SimulatedSubagents(build_kb(0))
    good = asyncio.run(sim.run(SubagentJob(deep["items"][1], {"h0": deep["gold"]["h0"]}, PROFILES["large"], seed=1)))
    bad = asyncio.run(sim.run(SubagentJob(deep["items"][1], {"h0": "Nowhere"}, PROFILES["large"], seed=1)))
    assert good.ok and good.answer == deep["gold"]["h1"]
    assert not bad.ok and "could not resolve" in bad.error


def test_llm_subagent_uses_tools_then_answers():
    kb = build_kb(0)
    entity, attr = ITEM["start"], ITEM["path"][0]
    llm = ScriptedLLM([f'{{"tool": "lookup", "args": {{"entity": "{entity}", "attribute": "{attr}"}}}}',
                       'I know it: {"answer": "42"}'])
    res = asyncio.run(LLMSubagents(llm, kb).run(SubagentJob(ITEM, {}, PROFILES["small"], seed=0)))
    assert res.ok and res.answer == "42" and res.steps == 2 and res.tool_calls == 1
    assert res.tokens_out > 0 and len(res.transcript) == 2


def test_llm_subagent_gives_up_after_max_steps_and_survives_errors():
    job = SubagentJob(ITEM, {}, PROFILES["small"], seed=0)
    res = asyncio.run(LLMSubagents(ScriptedLLM(["no idea"]), build_kb(0)).run(job))
    assert not res.ok and res.steps == PROFILES["small"].max_steps and "no answer" in res.error

    class Down(ScriptedLLM):
        async def chat(self, messages, **kw):
            raise LLMError("connection refused", url="http://x")

    res = asyncio.run(LLMSubagents(Down([""]), build_kb(0)).run(job))
    assert not res.ok and res.error.startswith("actor error")


def test_subtask_prompt_carries_dependency_answers():
    deep = generate_task("deep", 0, min_items=2, max_items=2)
    text = subtask_prompt(deep["items"][1], {"h0": "Tolmar"})
    assert deep["items"][1]["question"] in text and "the answer to h0 is Tolmar" in text
