"""Trainer benchmark: train-step throughput, and where an iteration's time goes.

    python -m aflow_rl.bench.trainer                   # CPU: tiny preset + a short quickstart run
    python -m aflow_rl.bench.trainer --skip-run        # only the train-step throughput
    python -m aflow_rl.bench.trainer --size 0.5b       # CUDA: ~0.5B random-init Qwen2 in bf16, with MFU

Part 1 times ``trainer.learner.train_step`` (DeepSpeed forward/backward/step
with the PPO loss) on synthetic turns of fixed length, and reports tokens/s
over every token the step processes (prompt + response). On CUDA it also
reports MFU = 6 * params * tokens/s / peak bf16 FLOP/s (the attention FLOPs
are left out, so MFU is a slight underestimate).

Part 2 runs ``train.py`` on the quickstart recipe for a few iterations in a
subprocess and reads the per-iteration split (rollout, train, sync) back from
its TensorBoard events.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from aflow_rl.bench import machine, write_json

# Dense bf16 peak of the accelerators this project is benchmarked on (FLOP/s, datasheet).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}

# Qwen2.5-0.5B's shape, randomly initialised (nothing is downloaded).
SIZE_05B = dict(vocab_size=32768, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096)


def synthetic_turns(n: int, prompt_len: int, response_len: int, vocab: int, seed: int):
    """Turns of fixed length with random ids; server logprobs near the model's scale."""
    from aflow_rl.rollout.types import Turn

    rng = np.random.default_rng(seed)
    return [Turn(prompt_ids=rng.integers(10, vocab, prompt_len), response_ids=rng.integers(10, vocab, response_len),
                 logprobs=-np.log(vocab) + 0.01 * rng.standard_normal(response_len)) for _ in range(n)]


def bench_train_step(args) -> dict:
    import torch

    from aflow_rl.config import load_config
    from aflow_rl.trainer.learner import build_engine, setup_distributed, train_step

    cuda = torch.cuda.is_available()
    overrides = [f"trainer.micro_batch_size={args.micro_batch}", "trainer.lr=1e-5",
                 f"trainer.max_steps={args.steps + args.warmup}"]
    if cuda:
        overrides += ["trainer.precision=bf16", "trainer.gradient_checkpointing=true"]
    cfg = load_config(None, overrides)
    setup_distributed()
    if args.size == "0.5b":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **SIZE_05B))
        vocab = SIZE_05B["vocab_size"]
    else:
        from aflow_rl.models.tiny import build

        model = build(os.path.join(tempfile.mkdtemp(), "m"), preset=args.size, seed=0)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model).vocab_size
    engine = build_engine(model, cfg.trainer)
    params = sum(p.numel() for p in engine.module.parameters())
    turns = synthetic_turns(args.batch, args.prompt_len, args.response_len, vocab, seed=0)
    adv = np.random.default_rng(1).standard_normal(len(turns))
    per_step = engine.train_micro_batch_size_per_gpu()
    engine.set_train_batch_size(per_step * -(-len(turns) // per_step))   # one optimizer step per batch
    tokens = args.batch * (args.prompt_len + args.response_len)
    times = []
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_step(engine, turns, adv, algo=cfg.algo, temperature=1.0)
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    med = float(np.median(times))
    out = {"params": params, "batch": args.batch, "prompt_len": args.prompt_len, "response_len": args.response_len,
           "step_s_median": med, "step_s_min": float(min(times)), "tokens_per_s": tokens / med,
           "precision": "bf16" if cuda else "fp32", "device": "cuda" if cuda else "cpu"}
    if cuda:
        name = torch.cuda.get_device_name(0)
        peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
        if peak:
            out["mfu"] = 6 * params * out["tokens_per_s"] / peak
            out["peak_flops"] = peak
    return out


def bench_iteration_split(args) -> dict:
    """Run the quickstart recipe briefly and read the time split from its events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tempfile.mkdtemp(prefix="bench-trainer-")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    model_dir = os.path.join(run_dir, "model")
    cmd = [sys.executable, os.path.join(root, "train.py"), os.path.join(root, "configs", "quickstart.yaml"),
           f"run.dir={run_dir}", f"serving.policy.model_path={model_dir}", f"trainer.max_steps={args.run_steps}",
           f"trainer.save_every={args.run_steps}"]
    t0 = time.perf_counter()
    from aflow_rl.trainer.learner import clean_dist_env

    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=clean_dist_env())
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed:\n{proc.stderr[-3000:]}")
    acc = EventAccumulator(os.path.join(run_dir, "events"), size_guidance={"scalars": 0})
    acc.Reload()
    # The first iteration pays one-off costs (grammar compile caches, allocator warm-up).
    mean = {tag: float(np.mean([e.value for e in acc.Scalars(tag)][1:]))
            for tag in ("timing/rollout_s", "timing/train_s", "timing/sync_s", "timing/step_s", "perf/tokens_per_s")}
    total = mean["timing/step_s"]
    return {"steps": args.run_steps, "wall_s": wall, **mean,
            **{f"share/{k.split('/')[1]}": mean[k] / total for k in ("timing/rollout_s", "timing/train_s", "timing/sync_s")}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Trainer throughput and iteration time split.")
    ap.add_argument("--size", default="tiny", choices=["tiny", "small", "0.5b"])
    ap.add_argument("--batch", type=int, default=32, help="sequences per train step")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--run-steps", type=int, default=8, help="quickstart iterations for the time split")
    ap.add_argument("--skip-run", action="store_true", help="skip the quickstart time split")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)

    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "train_step": bench_train_step(args)}
    ts = result["train_step"]
    print("machine: " + ", ".join(f"{k} {v}" for k, v in result["machine"].items()))
    print(f"train step ({args.size}, {ts['params'] / 1e6:.2f}M params, {ts['precision']}, {ts['device']}): "
          f"{args.batch} x ({args.prompt_len}+{args.response_len}) tokens, median {ts['step_s_median']:.3f} s "
          f"-> {ts['tokens_per_s']:.0f} tokens/s" + (f", MFU {100 * ts['mfu']:.1f}%" if "mfu" in ts else ""))
    if not args.skip_run:
        from aflow_rl.trainer.learner import teardown_distributed

        teardown_distributed()
        split = result["iteration"] = bench_iteration_split(args)
        print(f"quickstart iteration ({split['steps']} steps, {split['wall_s']:.0f} s wall): "
              f"step {split['timing/step_s']:.2f} s = rollout {split['timing/rollout_s']:.2f} s "
              f"({100 * split['share/rollout_s']:.0f}%) + train {split['timing/train_s']:.2f} s "
              f"({100 * split['share/train_s']:.0f}%) + sync {split['timing/sync_s']:.2f} s "
              f"({100 * split['share/sync_s']:.0f}%); train tokens/s {split['perf/tokens_per_s']:.0f}")
    if args.json:
        write_json(result, args.json)


if __name__ == "__main__":
    main()
