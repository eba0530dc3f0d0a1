"""DeepSpeed engine on the CPU accelerator: config, schedule, train step, KL reference, and a policy that learns."""
import json
import math

import numpy as np
import pytest
import torch

from aflow_rl.config import AlgoConfig, TrainerConfig
from aflow_rl.rollout.types import Turn
from aflow_rl.trainer.learner import build_ds_config, build_engine, load_reference, train_step, warmup_cosine

DESIGN_TAGS = ("losses/policy", "losses/kl", "losses/clipfrac", "losses/entropy", "losses/grad_norm",
               "charts/lr", "perf/tokens_per_s", "perf/logprob_mismatch")


def make_turns(n, seed=0):
    rng = np.random.default_rng(seed)
    return [Turn(prompt_ids=rng.integers(3, 1000, 4 + i % 3), response_ids=rng.integers(3, 1000, 2 + i % 4),
                 logprobs=np.full(2 + i % 4, -6.9)) for i in range(n)]


def params(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


def test_warmup_cosine():
    f = lambda s: warmup_cosine(s, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)  # noqa: E731
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert warmup_cosine(0, warmup_steps=0, total_steps=10, min_lr_ratio=0.0) == 1.0


def test_ds_config_from_trainer_section_and_json_override(tmp_path):
    tc = TrainerConfig(lr=3e-4, betas=[0.9, 0.95], micro_batch_size=2, grad_accum=3, grad_clip=0.5,
                       zero_stage=3, precision="bf16", weight_decay=0.01)
    cfg = build_ds_config(tc)
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 3
    assert cfg["gradient_clipping"] == 0.5 and cfg["bf16"] == {"enabled": True}
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                            "weight_decay": 0.01, "torch_adam": True}}
    assert "scheduler" not in cfg
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                "optimizer": {"params": {"lr": 0.5}}}))
    tc.deepspeed_config = str(path)
    cfg = build_ds_config(tc)
    assert cfg["zero_optimization"] == {"stage": 2, "stage3_gather_16bit_weights_on_model_save": True,
                                        "offload_optimizer": {"device": "cpu"}}
    assert cfg["optimizer"]["params"]["lr"] == 0.5 and cfg["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert "torch_adam" not in cfg["optimizer"]["params"]              # ZeRO-Offload needs DeepSpeedCPUAdam
    tc.deepspeed_config = str(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match="deepspeed_config"):
        build_ds_config(tc)


def test_train_step_updates_weights_and_follows_schedule(dist_info, tiny_model_dir):
    tc = TrainerConfig(lr=1e-3, micro_batch_size=2, grad_accum=2, warmup_steps=2, max_steps=4, min_lr_ratio=0.1)
    engine = build_engine(tiny_model_dir, tc)
    before = params(engine)
    lrs = []
    for it in range(3):
        stats = train_step(engine, make_turns(4, seed=it), [1.0, -1.0, 0.5, -0.5], algo=AlgoConfig())
        assert set(DESIGN_TAGS) <= set(stats)
        assert all(math.isfinite(v) for v in stats.values())
        assert stats["charts/optimizer_steps"] == 1.0 and stats["losses/grad_norm"] > 0
        lrs.append(stats["charts/lr"])
    # One optimizer step per call (4 sequences = 2 micro-batches x grad_accum 2).
    assert engine.global_steps == 3
    assert lrs == pytest.approx([1e-3 * warmup_cosine(s, warmup_steps=2, total_steps=4, min_lr_ratio=0.1)
                                 for s in range(3)])
    assert any(not torch.equal(a, b) for a, b in zip(before, params(engine)))
    # ppo_epochs=2 over 2 micro-batches with grad_accum 2: two optimizer steps, and the
    # second pass sees ratios != 1 (logp_old was recomputed before the first).
    stats = train_step(engine, make_turns(4, seed=9), [1.0, -1.0, 0.5, -0.5], algo=AlgoConfig(), ppo_epochs=2)
    assert stats["charts/optimizer_steps"] == 2.0 and stats["losses/ratio"] != 1.0


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_kl_to_reference(dist_info, tiny_model_dir, zero_stage):
    """Under ZeRO-3 the reference is partitioned too (an optimizer-less DeepSpeed engine)."""
    tc = TrainerConfig(lr=1e-2, micro_batch_size=4, grad_accum=1, max_steps=10, zero_stage=zero_stage)
    engine = build_engine(tiny_model_dir, tc)
    ref = load_reference(tiny_model_dir, engine)
    assert not any(p.requires_grad for p in ref.parameters())
    algo = AlgoConfig(kl_coef=0.1, kl_estimator="k3")
    turns, adv = make_turns(4, seed=5), [1.0, -1.0, 1.0, -1.0]
    first = train_step(engine, turns, adv, algo=algo, ref_model=ref)
    assert first["losses/kl"] == pytest.approx(0.0, abs=1e-7)         # same weights as the reference
    second = train_step(engine, turns, adv, algo=algo, ref_model=ref)
    assert second["losses/kl"] > 1e-6
    assert second["losses/total"] == pytest.approx(second["losses/policy"] + 0.1 * second["losses/kl"], rel=1e-5)


def test_tiny_policy_learns_constrained_choice(dist_info, tiny_model_dir):
    """From random init, a 1-of-4 grammar-constrained choice goes from chance to >= 0.9 success.

    Each iteration samples G responses in-process from the masked distribution (as
    the server would), rewards the target id, takes GRPO advantages and one PPO step.
    """
    torch.manual_seed(0)
    tc = TrainerConfig(lr=3e-3, micro_batch_size=32, grad_accum=1, max_steps=60, min_lr_ratio=1.0)
    engine = build_engine(tiny_model_dir, tc)
    V = engine.module.config.vocab_size
    prompt, choices, target, eos = [11, 12, 13, 14], [100, 200, 300, 400], 300, 2
    first = torch.zeros(V, dtype=torch.bool)
    first[choices] = True
    then_eos = torch.zeros(V, dtype=torch.bool)
    then_eos[eos] = True
    mask = torch.stack([first, then_eos])                                 # [T=2, V]
    gen = torch.Generator().manual_seed(0)

    def choice_probs():
        with torch.no_grad():
            logits = engine.module(input_ids=torch.tensor([prompt])).logits[0, -1]
        return torch.softmax(logits.masked_fill(~first, float("-inf")), -1)  # temperature 1

    p0 = float(choice_probs()[target])
    assert 0.1 < p0 < 0.45                                                # about chance (1/4)
    G = 32
    success = []
    for _ in range(tc.max_steps):
        probs = choice_probs()
        picks = torch.multinomial(probs, G, replacement=True, generator=gen)
        rewards = (picks == target).double()
        success.append(float(rewards.mean()))
        if float(probs[target]) >= 0.95:
            break
        if rewards.std() == 0:
            continue
        adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).numpy()
        turns = [Turn(prompt_ids=prompt, response_ids=[int(c), eos], logprobs=[float(probs[c].log()), 0.0])
                 for c in picks]
        stats = train_step(engine, turns, adv, algo=AlgoConfig(), grammar_masks=[mask] * G)
        assert stats["perf/logprob_mismatch"] < 1e-4                    # same weights, same formula
    assert float(choice_probs()[target]) >= 0.9
    assert np.mean(success[-3:]) >= 0.8 and np.mean(success[:3]) < 0.5


def _on_policy_turns(engine, n, seed):
    """Turns whose 'server' logprobs are the engine's own: an exact sync, so mismatch must be ~0."""
    from aflow_rl.trainer.batch import make_micro_batches, sequence_logprobs

    turns = make_turns(n, seed=seed)
    with torch.no_grad():
        for t in turns:
            mb = make_micro_batches([t], [0.0], micro_batch_size=1)[0]
            t.logprobs = sequence_logprobs(engine.module, mb, 1.0)[0][0, :len(t.response_ids)].numpy()
    return turns


def test_batch_size_changing_between_calls_steps_once_per_batch(dist_info, tiny_model_dir):
    # train.py resizes DeepSpeed's accumulation to every rollout batch. Batches of 3, then 5,
    # then 2 micro-batches: each call must make exactly one optimizer step at its own end, so
    # every micro-batch trains on the weights the server sampled with (mismatch ~0).
    tc = TrainerConfig(lr=1e-2, micro_batch_size=2, max_steps=10)
    engine = build_engine(tiny_model_dir, tc)
    for call, n in enumerate((6, 10, 4)):
        turns = _on_policy_turns(engine, n, seed=call)
        engine.set_train_batch_size(2 * math.ceil(n / 2))
        steps_before = engine.global_steps
        stats = train_step(engine, turns, np.linspace(-1, 1, n), algo=AlgoConfig())
        assert engine.global_steps == steps_before + 1, f"call {call}: optimizer stepped mid-batch"
        assert stats["perf/logprob_mismatch"] < 1e-5, (call, stats["perf/logprob_mismatch"])


def test_several_cpu_ranks_are_told_before_the_shm_op_compiles(tmp_path, monkeypatch, capsys):
    """One rank: the op is switched off (tests/test_train_loop.py runs that for real). Several CPU
    ranks need it; a compile of minutes gets one line first, unless torch's JIT cache has it."""
    import deepspeed.ops

    from aflow_rl.trainer import learner as eng

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, eng.SHM_OP, True)
    capsys.readouterr()
    eng._plan_shm_comm(2, 0)
    assert capsys.readouterr().out.splitlines()[-1].startswith("compiling DeepSpeed's deepspeed_shm_comm op for 2 CPU ranks (once: ")
    eng._plan_shm_comm(2, 1)                                            # other local ranks stay quiet
    (tmp_path / eng.SHM_OP / f"{eng.SHM_OP}.so").write_bytes(b"")      # where the JIT cache keeps the build
    eng._plan_shm_comm(2, 0)
    assert capsys.readouterr().out == ""
    eng._plan_shm_comm(1, 0)
    assert deepspeed.ops.__compatible_ops__[eng.SHM_OP] is False
