"""The offline tiny model: a normal HF directory, deterministic by seed."""
import hashlib
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from aflow_rl.models.tiny import EOS, PAD, build


def _digest(d):
    h = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        h.update(open(os.path.join(d, name), "rb").read())
    return h.hexdigest()


def test_hf_directory_loads(tiny_model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert os.path.isfile(os.path.join(tiny_model_dir, name)), name
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tok)
    assert tok.eos_token == EOS and tok.pad_token == PAD
    gen = json.load(open(os.path.join(tiny_model_dir, "generation_config.json")))
    assert gen["eos_token_id"] == tok.eos_token_id and gen["pad_token_id"] == tok.pad_token_id
    assert "chat_template" in json.load(open(os.path.join(tiny_model_dir, "tokenizer_config.json")))
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # Byte-level BPE round-trips the JSON actions the orchestrator emits.
    text = '{"action": "spawn", "n": 3, "subtasks": ["item 7"]}'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) < len(text)  # merges were learned
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()


def test_deterministic_by_seed(tmp_path, tiny_model_dir):
    again = build(str(tmp_path / "a"), preset="tiny", seed=0)
    other = build(str(tmp_path / "b"), preset="tiny", seed=1)
    assert _digest(again) == _digest(tiny_model_dir)
    assert _digest(other) != _digest(tiny_model_dir)


def test_mid_preset_shares_tiny_tokenizer_and_has_under_a_million_parameters(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mid = build(str(tmp_path / "mid"), preset="mid", seed=0)
    model = AutoModelForCausalLM.from_pretrained(mid)
    n = sum(p.numel() for p in model.parameters())
    assert 5e5 < n < 1e6 and model.config.num_hidden_layers == 3 and model.config.hidden_size == 128
    text = '{"action":"spawn","n":3}\nGraph: parallel then serial'
    assert (AutoTokenizer.from_pretrained(mid).encode(text)
            == AutoTokenizer.from_pretrained(tiny_model_dir).encode(text))
