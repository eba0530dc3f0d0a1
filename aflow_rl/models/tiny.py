"""Offline tiny Hugging Face models: a locally trained byte-level BPE tokenizer
plus a randomly initialised Qwen2 decoder.

    python -m aflow_rl.models.tiny --out models/tiny [--preset tiny|mid|small] [--seed 0]

Nothing is downloaded. The output is an ordinary HF directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML chat
template, generation_config.json with eos/pad ids) that AutoModelForCausalLM,
AutoTokenizer, the embedded server and SGLang all load. The same seed gives
the same files.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

PAD, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# ChatML, as Qwen2 uses: the assistant turn ends with <|im_end|> (our eos).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PRESETS = {
    # ~0.1M params: fast enough for the CPU test suite and the quickstart.
    "tiny": dict(vocab=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
    # ~0.7M params: the learning benchmark's step-up from tiny (3 layers of 128), the same
    # tokenizer as tiny so prompts and grammars are token-for-token the same.
    "mid": dict(vocab=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
    # ~4M params: for benchmarks and slower CPU experiments.
    "small": dict(vocab=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096),
}


def build_corpus(seed: int = 0, n: int = 4000) -> list[str]:
    """Text the project's models will see: prompts, JSON actions, arithmetic,
    code and plain English, generated deterministically from ``seed``."""
    rng = random.Random(seed)
    words = ("the a task item answer plan step subagent orchestrator spawn assign join finish replan "
             "tool call result score workflow operator review revise ensemble test program solve "
             "question number city country capital population river year name list find compute "
             "add subtract multiply divide total each first then next final check verify output "
             "input value key string integer true false null error retry budget parallel serial").split()
    actions = ["spawn", "assign", "join", "tool_call", "replan", "finish"]
    profiles = ["small", "medium", "large"]
    lines: list[str] = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            act = rng.choice(actions)
            body = {"action": act}
            if act == "spawn":
                body.update(n=rng.randint(1, 8), profile=rng.choice(profiles),
                            subtasks=[f"item {rng.randint(0, 99)}" for _ in range(rng.randint(1, 3))])
            elif act == "assign":
                body.update(subagent=rng.randint(0, 7), subtask=f"s{rng.randint(0, 20)}")
            elif act == "join":
                body.update(ids=[rng.randint(0, 7) for _ in range(rng.randint(1, 4))])
            elif act == "tool_call":
                body.update(tool=rng.choice(["lookup", "calc", "search"]), args={"query": rng.choice(words)})
            elif act == "replan":
                body.update(scope=rng.choice(["all", "failed", "remaining"]))
            else:
                body.update(answer=rng.choice(words) + " " + str(rng.randint(0, 999)))
            lines.append(json.dumps(body))
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            lines.append(f"What is {a} {op} {b}? Answer: {eval(f'{a}{op}{b}')}")
        elif kind == 2:
            name = rng.choice(words)
            lines.append(f"def {name}_{i}(x, y):\n    return x {rng.choice('+-*')} y\n")
        elif kind == 3:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(6, 20))).capitalize() + ".")
        elif kind == 4:
            lines.append(f"{BOS}user\nSolve the task: {' '.join(rng.choice(words) for _ in range(8))}{EOS}\n"
                         f"{BOS}assistant\n{{\"action\": \"{rng.choice(actions)}\"}}{EOS}")
        else:
            lines.append(f"Step {rng.randint(1, 9)}: {rng.choice(words)} = {rng.random():.3f}; "
                         f"[{rng.randint(0, 9)}, {rng.randint(0, 9)}] {{\"score\": {rng.randint(0, 100)}}}")
    return lines


def train_tokenizer(vocab: int, seed: int):
    """Byte-level BPE trained on the built-in corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(build_corpus(seed), trainer=trainer)
    return tok


def build(out: str, preset: str = "tiny", seed: int = 0) -> str:
    """Write a tokenizer + random-init Qwen2 model to ``out``; return ``out``."""
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    spec = dict(PRESETS[preset])
    tok = train_tokenizer(spec.pop("vocab"), seed)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token=EOS, pad_token=PAD,
                                     additional_special_tokens=[BOS], model_max_length=spec["max_position_embeddings"])
    hf_tok.chat_template = CHAT_TEMPLATE
    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id(PAD)

    config = Qwen2Config(vocab_size=tok.get_vocab_size(), tie_word_embeddings=True, rope_theta=10000.0,
                         bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
                         torch_dtype="float32", **spec)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()

    # Write into a temporary sibling, then rename: a reader never sees half a model.
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=parent)
    model.save_pretrained(tmp, safe_serialization=True)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, do_sample=True, temperature=1.0).save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    # transformers 5 keeps the template in chat_template.jinja; older loaders and
    # other servers read it from tokenizer_config.json, so it goes in both.
    tc_path = os.path.join(tmp, "tokenizer_config.json")
    with open(tc_path) as fh:
        tc = json.load(fh)
    tc["chat_template"] = CHAT_TEMPLATE
    with open(tc_path, "w") as fh:
        json.dump(tc, fh, indent=2)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model directory is shared
    if os.path.isdir(out):
        import shutil
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def ensure(out: str, preset: str = "tiny", seed: int = 0) -> str:
    """Build the model at ``out`` unless a complete one is already there."""
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        build(out, preset, seed)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (replaced if it exists)")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    build(args.out, args.preset, args.seed)
    print(f"wrote {args.preset} model (seed {args.seed}) to {args.out}")


if __name__ == "__main__":
    main()
