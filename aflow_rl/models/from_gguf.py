"""GGUF file -> plain Hugging Face model directory (dequantized safetensors + tokenizer).

    from aflow_rl.models.from_gguf import convert
    info = convert("model.Q4_1.gguf", "out_dir")   # {"parameters": ..., "architecture": ...}

transformers reads a GGUF itself (``from_pretrained(..., gguf_file=...)``, which needs the
``gguf`` and ``accelerate`` packages) and dequantizes every tensor to float32 on load. What it
returns still carries a GGUF quantization config, so a plain ``save_pretrained`` would write a
``config.json`` that sends the next loader back to the GGUF path. ``convert`` drops that config
and writes an ordinary directory: config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json (with the chat template) and chat_template.jinja, which
AutoModelForCausalLM, AutoTokenizer, the embedded server and DeepSpeed load like any other.
"""
from __future__ import annotations

import json
import os

# llama.cpp pre-tokenizer types whose split isolates every digit before the GPT-2 pattern
# (llama-vocab.cpp: regex_exprs = {"\\p{N}", <GPT-2 pattern>} for these types). transformers'
# GGUF loader knows none of them and falls back to the GPT-2 split alone, which turns "  12"
# into "Ġ Ġ 1 2" where the model was trained on "ĠĠ 1 2".
DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})


class GGUFConversionError(RuntimeError):
    """A GGUF file that cannot be turned into a Hugging Face directory."""


def _require_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if not _importable(name)]
    if missing:
        raise GGUFConversionError(f"reading a GGUF needs the {' and '.join(missing)} package(s); "
                                  f"install them with: pip install {' '.join(missing)}")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def read_metadata(gguf_path: str, keys: tuple[str, ...]) -> dict:
    """The scalar/string metadata ``keys`` present in the file (absent keys are left out)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf_path)
    except (ValueError, OSError) as exc:
        raise GGUFConversionError(f"{gguf_path} is not a readable GGUF file ({exc})") from None
    return {k: reader.fields[k].contents() for k in keys if k in reader.fields}


def digit_split_pre_tokenizer():
    """Each digit on its own, then byte-level BPE's GPT-2 split (the "smollm" type above)."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def load_tokenizer(gguf_path: str, pre_type: str | None):
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if pre_type in DIGIT_SPLIT_PRE:
        from tokenizers import decoders

        tok.backend_tokenizer.pre_tokenizer = digit_split_pre_tokenizer()
        # Byte-level BPE decodes by bytes alone; transformers 5.17 also put SentencePiece steps
        # (byte fallback, "▁" -> " ") in front, which lost a leading space of some texts.
        tok.backend_tokenizer.decoder = decoders.ByteLevel()
    return tok


# Tokenizer attribute -> the GGUF key holding its id, the file's own record of them.
SPECIAL_TOKENS = {"eos_token": "tokenizer.ggml.eos_token_id", "bos_token": "tokenizer.ggml.bos_token_id",
                  "pad_token": "tokenizer.ggml.padding_token_id", "unk_token": "tokenizer.ggml.unknown_token_id"}


def set_special_tokens(tok, meta: dict) -> None:
    """The special tokens the GGUF names, not the loader's guess: transformers 5.17 read SmolLM2's
    eos as ``<|im_start|>`` (id 1; the file says 2, ``<|im_end|>``), and the generation config
    copied from it then stopped on the wrong token."""
    for attr, key in SPECIAL_TOKENS.items():
        idx = meta.get(key)
        if idx is not None and 0 <= int(idx) < len(tok):
            setattr(tok, attr, tok.convert_ids_to_tokens(int(idx)))


def load_model(gguf_path: str):
    """Dequantized float32 model with the GGUF quantization config removed."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    # The weights are already plain float32 tensors; only the bookkeeping says "gguf".
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    return model


def _write_tokenizer(tok, out_dir: str, max_len: int) -> None:
    tok.model_max_length = max_len
    tok.save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as fh:
        tc = json.load(fh)
    # Loader-local keys that only describe where this copy was read from.
    for key in ("is_local", "local_files_only", "name_or_path"):
        tc.pop(key, None)
    # transformers 5 calls its fast tokenizer TokenizersBackend; the generic name also loads
    # in transformers 4 and SGLang. The template goes in the config too for older readers.
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tok.chat_template:
        tc["chat_template"] = tok.chat_template
    with open(path, "w") as fh:
        json.dump(tc, fh, indent=2)


def convert(gguf_path: str, out_dir: str) -> dict:
    """Write the HF directory for ``gguf_path`` into ``out_dir`` (created); return facts about it."""
    _require_packages()
    if not os.path.isfile(gguf_path):
        raise GGUFConversionError(f"no GGUF file at {gguf_path}")
    meta = read_metadata(gguf_path, ("general.architecture", "tokenizer.ggml.pre", "general.file_type",
                                     *SPECIAL_TOKENS.values()))
    tok = load_tokenizer(gguf_path, meta.get("tokenizer.ggml.pre"))
    set_special_tokens(tok, meta)
    model = load_model(gguf_path)
    if tok.eos_token_id is not None:
        # The loop stops on the generation config's eos; keep it equal to the tokenizer's.
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _write_tokenizer(tok, out_dir, int(getattr(model.config, "max_position_embeddings", 2048)))
    return {"architecture": meta.get("general.architecture"), "model_type": model.config.model_type,
            "parameters": sum(p.numel() for p in model.parameters()),
            "pre_tokenizer": meta.get("tokenizer.ggml.pre"), "dtype": "float32"}
