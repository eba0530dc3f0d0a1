"""trainer.sync=distributed against the real embedded server over gloo: the weights arrive (the
server's probe logprobs equal the trainer's, the new weight_version is served), buckets are
gathered one at a time under ZeRO-3 with 2 ranks, and a server that refuses, never answers, or
stops mid-sync fails the sync with WeightSyncError within trainer.sync_timeout_s."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from aflow_rl.config import ServerConfig, ServingConfig, load_config
from aflow_rl.llm.sglang import SGLangClient
from aflow_rl.serving.manager import ServerManager
from aflow_rl.serving.weight_sync import WeightSyncError, verify_servers
from aflow_rl.trainer.dist_sync import DistributedSync, plan_buckets
from tests.llm.conftest import FakeServer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROBE = [5, 6, 7, 8, 9, 10, 11]


def probe_logprobs(model) -> np.ndarray:
    with torch.no_grad():
        ids = torch.tensor([PROBE])
        logits = model(input_ids=ids).logits.float()[0, :-1]
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].numpy()


def embedded(model_dir: str, run_dir: str) -> ServerManager:
    serving = ServingConfig(policy=ServerConfig(backend="embedded", model_path=model_dir, threads=1,
                                                max_batch_size=4, startup_timeout_s=120.0),
                            actor=ServerConfig(backend="none"))
    return ServerManager(serving, run_dir)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """One embedded server (serving the seed-0 tiny model at first) for the tests of this module."""
    with embedded(tiny_model_dir, str(tmp_path_factory.mktemp("dist_sync_run"))) as servers:
        yield servers.urls("policy")


def test_learner_sync_distributed_to_embedded_server(server, dist_info, tiny_model_dir_b, tmp_path):
    """train.py's Learner.sync with trainer.sync=distributed: the seed-1 weights of the trainer's
    DeepSpeed engine replace the server's seed-0 ones, in several buckets, twice."""
    from transformers import AutoTokenizer

    from train import Learner
    from aflow_rl.trainer.learner import build_engine

    cfg = load_config(None, [f"run.dir={tmp_path}", "trainer.sync=distributed", "trainer.sync_bucket_mb=0.05",
                             "trainer.sync_timeout_s=60", f"serving.policy.model_path={tiny_model_dir_b}"])
    engine = build_engine(tiny_model_dir_b, cfg.trainer)
    learner = Learner(cfg, dist_info, engine, None, AutoTokenizer.from_pretrained(tiny_model_dir_b))
    client = SGLangClient(server, timeout_s=30.0, max_retries=0)
    expected = probe_logprobs(engine.module)
    # Control: before the sync the server's (seed-0) weights disagree, so the check below can fail.
    with pytest.raises(WeightSyncError, match="disagree"):
        asyncio.run(verify_servers(client, "default", probe_ids=PROBE, expected_logprobs=expected, tol=1e-4))
    try:
        assert len(plan_buckets(list(engine.module.named_parameters()), int(0.05 * 2**20))) > 2
        learner.sync(client, 3)   # raises unless the server serves version 3 with the trainer's logprobs
        asyncio.run(verify_servers(client, 3, probe_ids=PROBE, expected_logprobs=expected, tol=1e-4))
        with torch.no_grad():     # a second sync over the same group carries the changed weights
            engine.module.model.norm.weight.mul_(1.5)
        learner.sync(client, 4)
        mismatch = asyncio.run(verify_servers(client, 4, probe_ids=PROBE,
                                              expected_logprobs=probe_logprobs(engine.module), tol=1e-4))
        assert mismatch < 1e-4
        assert not np.allclose(probe_logprobs(engine.module), expected, atol=1e-3)   # the change was visible
    finally:
        learner.dist_sync.close()


def test_server_refusing_a_bucket_fails_at_once(server, tiny_model_dir_b):
    """A parameter the served model lacks: the server answers 400 before receiving, and the
    sync fails with its message without waiting for the timeout."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir_b, dtype=torch.float32)
    model.extra_head = torch.nn.Linear(4, 4)   # not in the served model
    client = SGLangClient(server, timeout_s=30.0, max_retries=0)
    sync = DistributedSync(bucket_mb=0.05, timeout_s=8.0, group_name="refuse_test")
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"update_weights_from_distributed refused.*unknown parameter "
                                                  r"'extra_head\.weight'") as err:
            sync.push(model, client, 7)
        assert server[0] in str(err.value)
        assert time.monotonic() - t0 < 6.0   # well before the 8 s timeout: the refusal, not the deadline
    finally:
        sync.close()
    # A restarted trainer: its connect ends the session the refused sync left open and replaces the group.
    del model.extra_head
    again = DistributedSync(bucket_mb=0.05, timeout_s=60.0, group_name="refuse_test")
    try:
        again.push(model, client, 8)
        asyncio.run(verify_servers(client, 8, probe_ids=PROBE, expected_logprobs=probe_logprobs(model), tol=1e-4))
    finally:
        again.close()


def test_server_that_never_answers_fails_within_the_timeout():
    """A server that accepts the connection but never answers /init_weights_update_group."""
    def reply(method, path, body, headers):
        if path == "/init_weights_update_group":
            time.sleep(30)
        return 200, {"success": True, "message": "ok"}

    fake = FakeServer(reply)
    client = SGLangClient([fake.url], timeout_s=60.0, max_retries=0)
    sync = DistributedSync(timeout_s=2.0, group_name="silent_test")
    model = torch.nn.Linear(2, 2)
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=fake.url.replace(".", r"\.")):
            sync.push(model, client, 1)
        assert time.monotonic() - t0 < 4.0
    finally:
        fake.close()


def test_server_stopped_mid_sync_fails_within_the_timeout(tiny_model_dir, tmp_path):
    """The group works, then the server process is stopped (SIGSTOP): the next sync, whose
    broadcast can never complete, fails at sync_timeout_s instead of hanging."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with embedded(tiny_model_dir, str(tmp_path / "run")) as servers:
        client = SGLangClient(servers.urls("policy"), timeout_s=30.0, max_retries=0)
        sync = DistributedSync(bucket_mb=0.05, timeout_s=5.0, group_name="stop_test")
        sync.push(model, client, 1)
        pid = servers.processes[0].proc.pid
        begin = sync._call_all

        async def begin_then_stop(client, path, payload, deadline):
            await begin(client, path, payload, deadline)
            if path == "/begin_weight_update":   # the session is open; the server stops before the buckets
                os.kill(pid, signal.SIGSTOP)

        sync._call_all = begin_then_stop
        try:
            t0 = time.monotonic()
            # gloo's sends of a small bucket may complete into socket buffers: the HTTP reply is what's
            # missing, and whichever of its timeout and the sync's deadline comes first names the server.
            with pytest.raises(WeightSyncError, match=r"127\.0\.0\.1:\d+/update_weights_from_distributed did not "
                                                      r"answer|could not receive a bucket within trainer\.sync_timeout_"
                                                      r"s=5 s \(no answer from \['http://127\.0\.0\.1:\d+'\]"):
                sync.push(model, client, 2)
            assert time.monotonic() - t0 < 8.0
        finally:
            os.kill(pid, signal.SIGCONT)


@pytest.mark.slow
def test_zero3_two_ranks_gather_bucket_by_bucket(server, tiny_model_dir_b, tmp_path):
    """torchrun --nproc_per_node=2, ZeRO-3: both ranks gather each bucket, rank 0 broadcasts; the
    server then serves the trainer's weights, and no more than one bucket was ever gathered."""
    out = tmp_path / "zero3.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(HERE, "dist_sync_zero3.py"), tiny_model_dir_b, server[0], str(out)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["buckets"] > 2
    assert res["mismatch"] < 1e-4                       # probe logprobs of the server == the trainer's
    assert res["served_version"] == "11"
    assert res["total_numel"] > res["max_gathered_numel"] > 0   # never all at once
    assert res["max_gathered_numel"] <= res["largest_bucket_numel"]


def test_embedded_routes_answer_like_sglang(server):
    """SGLang's {success, message} replies (400 on failure) for the misuses a trainer can make."""
    import httpx

    url = server[0]

    def post(path, body=None):
        r = httpx.post(url + path, json=body or {}, timeout=30, trust_env=False)
        return r.status_code, r.json()

    post("/end_weight_update")   # a session an earlier test's refused sync left open (as a dead trainer would)

    code, body = post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29999,
                                                     "rank_offset": 1, "world_size": 2})   # SGLang's default: nccl
    assert code == 400 and body["success"] is False and "use backend gloo" in body["message"]
    assert set(body) == {"success", "message"}
    code, body = post("/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": ["float32"],
                                                           "shapes": [[1024, 64]], "group_name": "nope"})
    assert code == 400 and "Please call `init_weights_update_group` first" in body["message"]
    assert post("/end_weight_update") == (400, {"success": False, "message": "no weight-update session is open; "
                                                                            "call begin_weight_update() first"})
    assert post("/begin_weight_update") == (200, {"success": True, "message": "Success"})
    assert post("/begin_weight_update")[0] == 400
    assert post("/end_weight_update") == (200, {"success": True, "message": "Success"})
    assert post("/destroy_weights_update_group", {"group_name": "nope"}) == (
        400, {"success": False, "message": "The group to be destroyed does not exist."})


@pytest.mark.parametrize("overrides,match", [
    (["trainer.sync=nfs"], "trainer.sync"),
    (["trainer.sync=distributed", "trainer.sync_bucket_mb=0"], "sync_bucket_mb: must be positive"),
    (["trainer.sync=distributed", "trainer.sync_master_port=70000"], "is not a port"),
    (["trainer.sync=distributed", "trainer.sync_backend=nccl", "serving.policy.backend=embedded"],
     "embedded policy server runs on CPU and joins over gloo"),
])
def test_config_refuses_unworkable_sync_settings(overrides, match):
    from aflow_rl.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_backend_auto_is_gloo_for_the_embedded_server():
    cfg = load_config(None, ["trainer.sync=distributed", "serving.policy.backend=embedded"])
    assert DistributedSync.from_config(cfg.trainer, "embedded").backend == "gloo"
    assert cfg.trainer.sync == "distributed" and load_config(None, []).trainer.sync == "disk"
