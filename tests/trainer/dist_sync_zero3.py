"""ZeRO-3 distributed weight sync with N ranks: every rank gathers each bucket, rank 0 broadcasts
it to the embedded server at URL; rank 0 then probes the server and writes OUT.json.

    torchrun --standalone --nproc_per_node=2 tests/trainer/dist_sync_zero3.py MODEL_DIR URL OUT.json

Run by tests/trainer/test_dist_sync.py. ``max_gathered_numel`` counts, inside each bucket's
gather, the elements of every parameter then available in full: it must never exceed one bucket.
"""
import asyncio
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from aflow_rl.config import TrainerConfig  # noqa: E402
from aflow_rl.llm.sglang import SGLangClient  # noqa: E402
from aflow_rl.serving.weight_sync import verify_servers  # noqa: E402
from aflow_rl.trainer import dist_sync  # noqa: E402
from aflow_rl.trainer.learner import build_engine, setup_distributed, teardown_distributed  # noqa: E402

PROBE = [5, 6, 7, 8, 9, 10, 11]
BUCKET_MB = 0.05


def main(model_dir: str, url: str, out: str) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    dist = setup_distributed()
    engine = build_engine(model_dir, TrainerConfig(zero_stage=3, lr=1e-3, micro_batch_size=1, max_steps=2))
    params = [p for _, p in engine.module.named_parameters()]
    seen = {"max": 0, "largest_bucket": 0}
    plain = dist_sync._gathered

    def watched(bucket_params, zero3):   # wraps the real gather: measures what is full inside it
        ctx = plain(bucket_params, zero3)

        class Watch:
            def __enter__(self):
                ctx.__enter__()
                full = sum(p.ds_numel for p in params if p.ds_status == ZeroParamStatus.AVAILABLE)
                seen["max"] = max(seen["max"], full)
                seen["largest_bucket"] = max(seen["largest_bucket"], sum(p.ds_numel for p in bucket_params))

            def __exit__(self, *exc):
                return ctx.__exit__(*exc)
        return Watch()

    dist_sync._gathered = watched
    client = SGLangClient([url], timeout_s=60.0, max_retries=0) if dist.is_main else None
    sync = dist_sync.DistributedSync(bucket_mb=BUCKET_MB, timeout_s=120.0, group_name="zero3_test")
    stats = sync.push(engine, client, 11)
    with torch.no_grad():   # collective under ZeRO-3: every rank runs the forward
        ids = torch.tensor([PROBE])
        logits = engine.module(input_ids=ids).logits.float()[0, :-1]
        expected = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].numpy()
    if dist.is_main:
        mismatch = asyncio.run(verify_servers(client, 11, probe_ids=PROBE, expected_logprobs=expected, tol=1e-4))
        info = client.http  # noqa: F841 - keeps the client alive until here
        reply = asyncio.run(client.get_model_info(url))
        with open(out, "w") as f:
            json.dump({"buckets": stats["buckets"], "mismatch": mismatch, "served_version": reply.get("weight_version"),
                       "max_gathered_numel": seen["max"], "largest_bucket_numel": seen["largest_bucket"],
                       "total_numel": sum(p.ds_numel for p in params)}, f)
        sync.close()
    teardown_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:4])
