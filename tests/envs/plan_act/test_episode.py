"""Plan/Act environment: reasoning-gym tasks and scoring, the planner turn, actor execution,
the planner-timeout fallback against a real endpoint that never answers, and one
end-to-end episode on the embedded server when it is available."""
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from aflow_rl.config import ClientConfig, Config
from aflow_rl.envs.plan_act.episode import extract_answer, parse_plan, planner_messages, run_plan_act_episode
from aflow_rl.envs.plan_act.tasks import make_tasks as make_plan_act_tasks
from aflow_rl.envs.plan_act.tasks import score_answer
from aflow_rl.llm.base import Completion, LLMError
from aflow_rl.rollout.turns import chat_prompt_ids
from aflow_rl.rollout.types import WorkerContext


def _cfg(**plan_act) -> Config:
    cfg = Config()
    for k, v in plan_act.items():
        setattr(cfg.env.plan_act, k, v)
    return cfg


class CharTokenizer:
    """Deterministic stand-in for an HF tokenizer: one id per character."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 997 for c in text]


class FakePlanner:
    base_url = "fake://planner"

    def __init__(self, plan="1. Read the expression.\n2. Evaluate it left to right.", delay=0.0, error=None):
        self.plan, self.delay, self.error, self.calls = plan, delay, error, []

    async def generate(self, prompt=None, *, input_ids=None, return_logprob=False, **sampling):
        self.calls.append({"input_ids": list(input_ids), "return_logprob": return_logprob, **sampling})
        if self.error:
            raise self.error
        await asyncio.sleep(self.delay)
        ids = [11, 12, 13, 14]
        return Completion(text=self.plan, output_ids=ids, logprobs=[-0.5] * len(ids), weight_version="3")

    async def chat(self, messages, **sampling):  # pragma: no cover - the planner is driven by generate
        raise AssertionError("planner must go through generate (token ids + logprobs)")

    async def aclose(self):
        pass


class FakeActor:
    base_url = "fake://actor"

    def __init__(self, reply):
        self.reply, self.calls = reply, []

    async def chat(self, messages, **sampling):
        self.calls.append({"messages": messages, **sampling})
        text = self.reply(len(self.calls)) if callable(self.reply) else self.reply
        return Completion(text=text, prompt_tokens=20, completion_tokens=5)

    async def generate(self, prompt=None, **kw):  # pragma: no cover
        raise AssertionError("actor steps use chat")

    async def aclose(self):
        pass


class ListTrace:
    def __init__(self):
        self.events = []

    def event(self, episode_id, **fields):
        self.events.append({"episode_id": episode_id, **fields})


@pytest.fixture(scope="module")
def task():
    t = make_plan_act_tasks(_cfg(dataset="basic_arithmetic"), 4, seed=7)[1]
    return dict(t, episode_id="ep-1", group_id="g-1", attempt=2)


# ---------------------------------------------------------------------------
# Tasks and scoring
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["basic_arithmetic", "gsm_symbolic"])
def test_tasks_deterministic_and_scored_by_reasoning_gym(name):
    import reasoning_gym

    cfg = _cfg(dataset=name)
    a, b = make_plan_act_tasks(cfg, 5, seed=3), make_plan_act_tasks(cfg, 5, seed=3)
    assert a == b
    assert [t["question"] for t in a] != [t["question"] for t in make_plan_act_tasks(cfg, 5, seed=4)]
    assert json.loads(json.dumps(a)) == a
    ref = reasoning_gym.create_dataset(name, size=5, seed=3)
    for i, t in enumerate(a):
        assert (t["dataset"], t["index"]) == (name, i)
        assert (t["question"], t["answer"]) == (ref[i]["question"], ref[i]["answer"])
        assert score_answer(t, t["answer"]) == 1.0
        assert score_answer(t, str(int(float(t["answer"])) + 1)) < 1.0
        assert score_answer(t, None) < 1.0


def test_parse_plan_numbered_merged_and_unusable():
    plan = "Plan:\n1. add 2 and 3\n   carefully\n2) multiply by 4\nStep 3: subtract 1\n4. check"
    assert parse_plan(plan, 4) == ["add 2 and 3 carefully", "multiply by 4", "subtract 1", "check"]
    assert parse_plan(plan, 2) == ["add 2 and 3 carefully", "multiply by 4 subtract 1 check"]
    assert parse_plan("just do it", 4) == []
    assert parse_plan("", 4) == []


@pytest.mark.parametrize("text,expected", [
    ("work\nAnswer: -4", "-4"),
    ("Answer: 12\nmore text\nThe final answer is 42.", "42"),
    ("so we get **17**.\nAnswer: **17**.", "17"),
    ("thus \\boxed{3.5}", "3.5"),
    ("first line\n  288  \n", "288"),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# ---------------------------------------------------------------------------
# Episodes with in-test clients
# ---------------------------------------------------------------------------


def test_episode_planner_then_actor_steps(task):
    cfg = _cfg(max_plan_tokens=50, max_act_tokens=20)
    tok, planner, trace = CharTokenizer(), FakePlanner(), ListTrace()
    actor = FakeActor(lambda k: "Evaluated." if k == 1 else f"so\nAnswer: {task['answer']}")
    ctx = WorkerContext(config=cfg, state={"policy_client": planner, "actor_client": actor,
                                           "tokenizer": tok, "trace": trace})
    traj = asyncio.run(run_plan_act_episode(task, ctx))

    assert (traj.status, traj.episode_id, traj.group_id, traj.attempt) == ("ok", "ep-1", "g-1", 2)
    assert traj.metrics["success"] == 1.0 and traj.reward_components["r_perf"] == 1.0
    assert traj.reward_components == {"r_perf": 1.0, "r_parallel": 0.0, "r_finish": 0.0, "format": 0.0}
    assert traj.final_reward == 1.0 and traj.metrics["planner_fallback"] == 0.0
    (turn,) = traj.turns
    want = chat_prompt_ids(tok, planner_messages(task["question"]))
    assert turn.prompt_ids.tolist() == want == planner.calls[0]["input_ids"]
    assert turn.response_ids.tolist() == [11, 12, 13, 14] and len(turn.logprobs) == 4
    assert turn.policy_version == 3 and turn.step_reward == 0.0 and turn.grammar is None
    assert planner.calls[0]["return_logprob"] and planner.calls[0]["max_new_tokens"] == 50
    assert planner.calls[0]["temperature"] == cfg.env.temperature

    # Two plan steps -> two actor calls; the second sees the first one's output and asks for the answer.
    assert traj.metrics["actor_steps"] == 2 and traj.metrics["plan_steps"] == 2
    assert all(c["max_new_tokens"] == 20 for c in actor.calls)
    second = actor.calls[1]["messages"][-1]["content"]
    assert "Step 1 result: Evaluated." in second and "Evaluate it left to right" in second and "Answer:" in second
    assert traj.metrics["tokens_in"] == len(want) + 2 * 20
    assert traj.metrics["tokens_out"] == 4 + 2 * 5
    assert traj.metrics["critical_steps"] == 3

    assert [e["step"] for e in trace.events] == [0, 1, 2, 3]
    assert {e["episode_id"] for e in trace.events} == {"ep-1"}
    assert trace.events[-1]["reward"] == 1.0 and trace.events[-1]["observation"] == task["answer"]
    json.dumps(traj.to_dict())


def test_wrong_answer_scores_below_one_and_missing_answer_is_asked_for(task):
    wrong = str(int(float(task["answer"])) + 5)
    actor = FakeActor(lambda k: "I computed something." if k <= 2 else f"Answer: {wrong}")
    ctx = WorkerContext(config=_cfg(), state={"policy_client": FakePlanner(), "actor_client": actor,
                                              "tokenizer": CharTokenizer()})
    traj = asyncio.run(run_plan_act_episode(task, ctx))
    assert traj.status == "ok" and traj.metrics["success"] == 0.0
    assert traj.reward_components["r_perf"] < 1.0
    assert traj.metrics["actor_steps"] == 3  # two steps, then one explicit request for the answer
    assert traj.info["answer"] == wrong


def test_unusable_plan_gets_format_penalty_and_still_runs(task):
    actor = FakeActor(f"Answer: {task['answer']}")
    planner = FakePlanner(plan="I would think about it.")
    traj = asyncio.run(run_plan_act_episode(task, WorkerContext(config=_cfg(format_penalty=-0.2)),
                                            policy_client=planner, actor_client=actor,
                                            tokenizer=CharTokenizer()))
    assert traj.reward_components["format"] == -0.2 and traj.reward_components["r_perf"] == 1.0
    assert traj.final_reward == pytest.approx(0.8) and traj.turns[0].step_reward == 0.0
    assert "I would think about it." in actor.calls[0]["messages"][-1]["content"]


# ---------------------------------------------------------------------------
# Planner fallback
# ---------------------------------------------------------------------------


class SilentServer:
    """A TCP endpoint that accepts connections and never replies (a hung planner)."""

    def __enter__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.conns, self.stop = [], threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        return self

    def _accept(self):
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                continue

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(2)
        for c in self.conns:
            c.close()
        self.sock.close()


def _hung_planner(url):
    """A real SGLang client to the silent server: the timeout must come from the episode, not the client."""
    from aflow_rl.llm import make_client

    return make_client(ClientConfig(provider="sglang", timeout_s=120.0, max_retries=0), [url])


async def _episode_against(url, task, cfg, actor):
    planner = _hung_planner(url)
    try:
        t0 = time.perf_counter()
        traj = await run_plan_act_episode(task, WorkerContext(config=cfg), policy_client=planner,
                                          actor_client=actor, tokenizer=CharTokenizer())
        return traj, time.perf_counter() - t0
    finally:
        await planner.aclose()


@pytest.mark.timeout(30)
def test_planner_timeout_falls_back_to_actor_alone(task):
    timeout = 0.5
    actor = FakeActor(f"Answer: {task['answer']}")
    with SilentServer() as server:
        traj, elapsed = asyncio.run(_episode_against(server.url, task, _cfg(timeout_s=timeout), actor))
        assert server.conns, "the real client never reached the planner endpoint"
    assert elapsed < timeout + 1.5
    assert traj.status == "ok" and traj.turns == []
    assert traj.metrics["planner_fallback"] == 1.0 and traj.info["fallback"] == "planner_timeout"
    assert traj.metrics["planner_latency_ms"] >= 1000 * timeout * 0.9
    assert traj.metrics["actor_steps"] == 1 and traj.metrics["success"] == 1.0
    assert traj.reward_components["format"] == 0.0
    assert "Plan:" not in actor.calls[0]["messages"][-1]["content"]


@pytest.mark.timeout(30)
def test_planner_timeout_without_fallback_is_status_timeout(task):
    actor = FakeActor("Answer: 1")
    with SilentServer() as server:
        traj, elapsed = asyncio.run(_episode_against(
            server.url, task, _cfg(timeout_s=0.3, fallback_on_timeout=False), actor))
    assert elapsed < 0.3 + 1.5
    assert traj.status == "timeout" and "0.3" in traj.error
    assert traj.turns == [] and actor.calls == [] and traj.metrics["planner_fallback"] == 0.0
    assert "fallback" not in traj.info


def test_planner_error_falls_back_or_raises(task):
    actor = FakeActor(f"Answer: {task['answer']}")
    planner = FakePlanner(error=LLMError("connection refused", url="http://x"))
    kw = dict(policy_client=planner, actor_client=actor, tokenizer=CharTokenizer())
    traj = asyncio.run(run_plan_act_episode(task, WorkerContext(config=_cfg()), **kw))
    assert traj.info["fallback"] == "planner_error" and traj.metrics["planner_fallback"] == 1.0
    with pytest.raises(LLMError):
        asyncio.run(run_plan_act_episode(task, WorkerContext(config=_cfg(fallback_on_timeout=False)), **kw))


# ---------------------------------------------------------------------------
# End to end on the embedded server
# ---------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def embedded_server(request, tmp_path_factory):
    import httpx

    tiny_model_dir = request.getfixturevalue("tiny_model_dir")  # built only when the server can run

    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "aflow_rl.serving.embedded", "--model-path", tiny_model_dir,
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    else:
        proc.kill()
        log.seek(0)
        pytest.fail(f"embedded server did not come up:\n{log.read()[-3000:]}")
    yield url, tiny_model_dir
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def test_end_to_end_tiny_model_as_planner_and_actor(task, embedded_server):
    from transformers import AutoTokenizer

    from aflow_rl.llm import make_client

    url, tiny_model_dir = embedded_server
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = _cfg(max_plan_tokens=24, max_act_tokens=12, timeout_s=60.0)

    async def episode():
        policy = make_client(ClientConfig(provider="sglang"), [url])
        actor = make_client(ClientConfig(provider="sglang"), [url])
        try:
            return await run_plan_act_episode(task, WorkerContext(config=cfg), policy_client=policy,
                                              actor_client=actor, tokenizer=tok)
        finally:
            await policy.aclose()
            await actor.aclose()

    traj = asyncio.run(episode())
    assert traj.status == "ok", traj.error
    assert traj.metrics["planner_fallback"] == 0.0 and traj.metrics["actor_steps"] >= 1
    (turn,) = traj.turns
    assert turn.prompt_ids.tolist() == chat_prompt_ids(tok, planner_messages(task["question"]))
    assert 0 < len(turn.response_ids) <= 24 and len(turn.logprobs) == len(turn.response_ids)
    assert (turn.logprobs <= 0).all()
    assert 0.0 <= traj.reward_components["r_perf"] <= 1.0
