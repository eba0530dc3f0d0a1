"""Grammar masks the trainer replays: shape, content, and failure on violating responses."""
import json

import pytest
import torch

from aflow_rl.serving.grammar import (GrammarBackend, GrammarError, GrammarSpec, grammar_bitmasks, grammar_masks,
                                      spec_from_params, unpack_bitmask)

SCHEMA = {"type": "object", "properties": {"action": {"enum": ["spawn", "join"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["action", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    return GrammarBackend.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_masks_allow_each_token_of_a_valid_response_and_only_eos_at_the_end(backend, tok):
    ids = tok.encode('{"action": "join", "n": 3}') + [tok.eos_token_id]
    masks = grammar_masks({"json_schema": json.dumps(SCHEMA)}, ids, backend=backend)
    assert masks.shape == (len(ids), backend.vocab_size) and masks.dtype == torch.bool
    assert all(masks[t, tok_id] for t, tok_id in enumerate(ids))
    # Before the first token only '{'-starting tokens can follow; most of the vocabulary is masked.
    assert 0 < masks[0].sum() < backend.vocab_size // 10
    first_allowed = [tok.decode([i]) for i in masks[0].nonzero().flatten().tolist()]
    assert all(s.startswith("{") for s in first_allowed), first_allowed
    # Once the object is closed, the end of sequence is the only way on.
    assert masks[-1].nonzero().flatten().tolist() == [tok.eos_token_id]


def test_masks_reject_a_response_that_breaks_the_grammar(backend, tok):
    bad = tok.encode('{"action": "fly", "n": 3}')
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        grammar_masks({"json_schema": json.dumps(SCHEMA)}, bad, backend=backend)
    done = tok.encode("yes") + [tok.eos_token_id, tok.eos_token_id]
    with pytest.raises(ValueError, match="after the grammar terminated"):
        grammar_masks(GrammarSpec("regex", "(yes|no)"), done, backend=backend)


def test_regex_masks_and_spec_forms_agree(backend, tok):
    ids = tok.encode("no") + [tok.eos_token_id]
    a = grammar_masks({"regex": "(yes|no)"}, ids, backend=backend)
    b = grammar_masks(GrammarSpec("regex", "(yes|no)"), ids, backend=backend)
    c = grammar_masks(backend.compile(GrammarSpec("regex", "(yes|no)")), ids, backend=backend)
    assert torch.equal(a, b) and torch.equal(a, c)
    packed = grammar_bitmasks({"regex": "(yes|no)"}, ids, backend=backend)
    assert torch.equal(unpack_bitmask(packed, backend.vocab_size), a)


def test_invalid_specs_raise_grammar_error_with_the_compiler_message(backend):
    with pytest.raises(GrammarError, match="json_schema"):
        backend.compile({"json_schema": "{not json"})
    with pytest.raises(GrammarError, match="regex"):
        backend.compile({"regex": "(unclosed"})
    with pytest.raises(GrammarError, match="only one"):
        spec_from_params({"json_schema": "{}", "regex": "a"})
    assert spec_from_params({"json_schema": {"type": "integer"}}).value == '{"type": "integer"}'
    assert spec_from_params({"max_new_tokens": 3}) is None


def test_unpack_bitmask_bit_order():
    bitmask = torch.zeros((1, 2), dtype=torch.int32)
    bitmask[0, 0] = -2 ** 31          # bit 31 of word 0 -> token 31
    bitmask[0, 1] = 0b101             # bits 0 and 2 of word 1 -> tokens 32, 34
    assert unpack_bitmask(bitmask, 40)[0].nonzero().flatten().tolist() == [31, 32, 34]


def _byte_token(tok, byte: int) -> int:
    """Id of the single-byte token for ``byte`` in a GPT-2 style byte-level vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char = chr(byte) if byte in printable else chr(256 + [b for b in range(256) if b not in printable].index(byte))
    return tok.convert_tokens_to_ids(char)


def test_json_strings_refuse_control_characters_and_surrogates(backend, tok):
    # A bounded string (maxLength) and a free one: neither may hold a raw control
    # character or a UTF-8-encoded surrogate, both of which json.loads / UTF-8 reject.
    for prop in ({"type": "string", "maxLength": 6}, {"type": "string"}):
        schema = json.dumps({"type": "object", "properties": {"s": prop}, "required": ["s"]})
        prefix = tok.encode('{"s": "a')
        masks = grammar_masks({"json_schema": schema}, prefix + [_byte_token(tok, 0xC3)], backend=backend)
        allowed = masks[len(prefix)]
        assert allowed[_byte_token(tok, 0xC3)]            # a lead byte of 'é' is fine
        assert not allowed[_byte_token(tok, 0x05)]        # raw control character
        after_ed = grammar_masks({"json_schema": schema}, prefix + [_byte_token(tok, 0xED), _byte_token(tok, 0x9F)],
                                 backend=backend)[-1]
        assert after_ed[_byte_token(tok, 0x9F)]           # \xed\x9f.. is U+D7xx, valid
        with pytest.raises(ValueError):                   # \xed\xa2.. would be a surrogate
            grammar_masks({"json_schema": schema}, prefix + [_byte_token(tok, 0xED), _byte_token(tok, 0xA2)],
                          backend=backend)


def test_compiled_grammars_are_cached_by_spec_and_evicted_lru(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    b = GrammarBackend(tok, len(tok), cache_size=2)
    schema = json.dumps(SCHEMA)
    first = b.compile({"json_schema": schema})
    assert b.cache.stats() == {"hits": 0, "misses": 1, "size": 1, "capacity": 2}
    assert b.compile(GrammarSpec("json_schema", schema)) is first          # same text: the same object
    assert b.cache.hits == 1
    b.compile({"regex": "(yes|no)"})
    b.compile({"json_schema": schema})                                      # refreshes the schema's recency
    b.compile({"regex": "[0-9]+"})                                          # evicts (yes|no), the oldest
    assert b.cache.stats()["size"] == 2
    misses = b.cache.misses
    b.compile({"regex": "(yes|no)"})
    assert b.cache.misses == misses + 1
    assert b.compile({"json_schema": schema}) is not None
    # A kind is part of the key: the same text as a regex is a different grammar.
    assert GrammarSpec("regex", schema) != GrammarSpec("json_schema", schema)


def test_failed_compilations_are_not_cached(backend):
    size = len(backend.cache)
    for _ in range(2):
        with pytest.raises(GrammarError):
            backend.compile({"regex": "(unclosed"})
    assert len(backend.cache) == size
