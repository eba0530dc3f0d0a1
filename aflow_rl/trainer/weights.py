"""Hugging Face export of the trained policy, written atomically.

The sync directory is read by a server (``/update_weights_from_disk``) while the
trainer writes the next version, so a reader must never see half a directory:
everything goes into a temporary sibling first, then takes the final name by
rename. Under ZeRO-3 each rank holds a slice of every weight: the full state
dict is gathered layer by layer onto rank 0, so every rank must call
:func:`export_hf`; only rank 0 writes.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from aflow_rl.dist import rank


def _replace_dir(src: str, dst: str) -> None:
    """Move directory ``src`` to ``dst``, replacing an existing ``dst``.

    ``os.replace`` cannot overwrite a non-empty directory, so the old one is first
    renamed aside: readers see the old or the new directory, apart from the
    instant between two renames. Use a new ``dst`` per version to avoid even that.
    """
    if os.path.exists(dst):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=os.path.dirname(dst))
        os.rmdir(old)
        os.rename(dst, old)
        os.rename(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(src, dst)


def _save_tokenizer(tokenizer: Any, out_dir: str) -> None:
    if tokenizer is None:
        return
    if isinstance(tokenizer, str):   # a model directory: re-save its tokenizer files
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    tokenizer.save_pretrained(out_dir)


def export_hf(engine_or_model: Any, tokenizer: Any, out_dir: str) -> str:
    """Write ``out_dir`` as a Hugging Face model directory (safetensors, config,
    generation config, tokenizer) that ``AutoModelForCausalLM.from_pretrained``
    and SGLang load.

    ``engine_or_model``: a DeepSpeed engine or the HF model. ``tokenizer``: a
    tokenizer, a directory to take it from, or None. Collective under ZeRO-3 (call
    on every rank); only rank 0 writes. Returns ``out_dir``.
    """
    engine = engine_or_model if hasattr(engine_or_model, "zero_optimization_partition_weights") else None
    model = engine.module if engine is not None else engine_or_model
    state_dict = None
    if engine is not None and engine.zero_optimization_partition_weights():
        state_dict = engine._zero3_consolidated_16bit_state_dict()   # full weights on rank 0, None elsewhere
    if rank() != 0:
        return out_dir
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        _save_tokenizer(tokenizer, tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
