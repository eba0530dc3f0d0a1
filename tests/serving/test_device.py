"""The embedded engine's ``device``: config and CLI plumbing and clear errors on CPU; on a GPU
(``gpu`` marker) the same script of requests as tests/serving/test_prefix_cache.py gives the CPU
engine's tokens, with logprobs within fp32 rounding, and a weight update lands on the GPU."""
import threading

import pytest
import torch

from aflow_rl.config import ConfigError, load_config
from aflow_rl.serving import manager as mgr
from aflow_rl.serving.embedded import build_parser
from aflow_rl.serving.generation import Engine, resolve_device
from tests.serving.test_prefix_cache import _prompts, _script, greedy, run

LP_TOL = 1e-3    # CPU vs CUDA fp32 kernels sum in different orders


@pytest.mark.parametrize("name", ["GPU0", "cuda:x", "mps", "tpu:0", ""])
def test_unknown_device_names_are_refused(name):
    with pytest.raises(ValueError, match="use cpu, cuda or cuda:N"):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no CUDA GPU is visible")
def test_cuda_without_a_gpu_says_so_instead_of_falling_back():
    with pytest.raises(ValueError, match="sees no CUDA GPU; use device cpu"):
        resolve_device("cuda")


def test_cpu_is_the_default_everywhere():
    assert resolve_device("cpu") == torch.device("cpu")
    assert build_parser().parse_args(["--model-path", "/m"]).device == "cpu"
    cfg = load_config("configs/test.yaml")
    assert cfg.serving.actor.device == cfg.serving.policy.device == "cpu"
    assert "--device" not in mgr.embedded_command(cfg.serving.actor, 1234)


def test_config_device_reaches_the_server_command_line():
    cfg = load_config("configs/aflow_smol.yaml", ["serving.actor.device=cuda:1"])
    cmd = mgr.embedded_command(cfg.serving.actor, 1234)
    assert cmd[cmd.index("--device") + 1] == "cuda:1"
    assert build_parser().parse_args(["--model-path", "/m", "--device", "cuda:1"]).device == "cuda:1"


@pytest.mark.parametrize("overrides, message", [
    (["serving.actor.device=gpu"], "serving.actor.device: expected cpu, cuda or cuda:N, got 'gpu'"),
    (["serving.policy.backend=sglang", "serving.policy.device=cuda"], "only the embedded backend takes a device"),
])
def test_config_refuses_a_bad_device(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/test.yaml", overrides)


@pytest.mark.gpu
def test_cuda_engine_gives_the_cpu_engines_tokens_and_takes_weight_updates(tiny_model_dir, tiny_model_dir_b):
    gpu = Engine(tiny_model_dir, prefix_cache=True, prefill_chunk=16, random_seed=0, device="cuda")
    cpu = Engine(tiny_model_dir, prefix_cache=True, prefill_chunk=16, random_seed=0)
    gpu.start(), cpu.start()
    try:
        assert next(gpu.model.parameters()).device.type == "cuda"
        got, ref = _script(gpu), _script(cpu)
        assert len(got) == len(ref) > 10
        for a, b in zip(got, ref):
            assert a.output_ids == b.output_ids
            assert a.cached_tokens == b.cached_tokens
            diff = max((abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)), default=0.0)
            assert diff < LP_TOL, diff
        done, box = threading.Event(), []
        gpu.update_weights_from_disk(tiny_model_dir_b, "b", lambda ok, msg: (box.append((ok, msg)), done.set()))
        assert done.wait(120) and box[0][0], box
        assert next(gpu.model.parameters()).device.type == "cuda"
        _, prompts = _prompts()
        after = run(gpu, [greedy(prompts[1])])[0]
        assert after.weight_version == "b" and after.output_logprobs != got[4].output_logprobs
    finally:
        gpu.shutdown(), cpu.shutdown()


@pytest.mark.gpu
def test_trainer_logprobs_with_packed_grammar_masks_on_cuda_match_the_cpu(tiny_model_dir):
    """The trainer's side on a GPU: a batch on CUDA with packed (int32) grammar masks from the CPU,
    unpacked on the GPU (a CPU shift table there once failed), gives the CPU's logprobs."""
    from transformers import AutoModelForCausalLM

    from aflow_rl.serving.grammar import unpack_bitmask
    from aflow_rl.trainer.batch import collate, sequence_logprobs
    from tests.trainer.test_batch import make_turns, pack, random_masks

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    V = model.config.vocab_size
    turns = make_turns(3, seed=5)
    packed = [pack(m) for m in random_masks(turns, V, seed=1)]
    assert torch.equal(unpack_bitmask(packed[0].cuda(), V).cpu(), unpack_bitmask(packed[0], V))
    mb = collate(turns, [0.0] * 3, grammar_masks=packed)
    want, _ = sequence_logprobs(model, mb, 0.8)
    got, _ = sequence_logprobs(model.cuda(), mb.to("cuda"), 0.8)
    assert got.device.type == "cuda"
    assert torch.allclose(got.cpu(), want, atol=1e-4)
