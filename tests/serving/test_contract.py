"""SGLang's request contract (types, ranges, key sets) as aflow_rl.serving.contract keeps it.

Expected values come from SGLang 0.5.23's code: ``sglang/srt/sampling/sampling_params.py``
(verify, normalize, get_max_seq_length) and ``sglang/api/v1/api_types.py`` (the JSON contract).
"""
import logging

import pytest

from aflow_rl.serving import contract
from aflow_rl.serving.contract import ContractError

# sampling_params fields of sglang.api.v1.api_types.SamplingParams (0.5.23), unknown keys rejected there.
SGLANG_SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice"}
# Top-level fields of sglang.api.v1.api_types.GenerateRequest (0.5.23).
SGLANG_GENERATE_FIELDS = {
    "rid", "text", "input_ids", "stream", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_hidden_states", "return_text_in_logprobs", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
    "disagg_prefill_dp_rank", "image_data", "mm_hashes", "video_data", "audio_data", "extra_key", "priority",
    "cache_salt", "require_reasoning", "lora_path", "session_params", "kv_hints", "routing_key",
    "max_thinking_tokens", "session_id", "custom_logit_processor", "custom_labels", "images_config",
    "return_prompt_token_ids", "routed_experts_start_len", "return_sampling_mask", "modalities"}


def test_every_sglang_sampling_key_has_a_decision():
    assert contract.SAMPLING_KEYS == SGLANG_SAMPLING_KEYS
    sets = [contract.SAMPLING_IMPLEMENTED, set(contract.SAMPLING_NEUTRAL), contract.SAMPLING_IGNORED]
    assert sum(len(s) for s in sets) == len(SGLANG_SAMPLING_KEYS)        # each key in exactly one set


def test_every_sglang_generate_field_has_a_decision():
    decided = contract.GENERATE_IMPLEMENTED | set(contract.GENERATE_NEUTRAL) | contract.GENERATE_IGNORED
    assert SGLANG_GENERATE_FIELDS <= decided, SGLANG_GENERATE_FIELDS - decided


def test_sglang_frontend_defaults_pass():
    # What sglang.lang's SglSamplingParams.to_srt_kwargs sends when a program sets nothing.
    contract.check_sampling_keys({"max_new_tokens": 128, "min_new_tokens": 0, "n": 1, "stop": [],
                                  "stop_token_ids": [], "stop_regex": [], "temperature": 1.0, "top_p": 1.0,
                                  "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                                  "ignore_eos": False, "regex": None, "json_schema": None,
                                  "skip_special_tokens": True, "spaces_between_special_tokens": True})


@pytest.mark.parametrize("raw,needle", [
    ({"bogus": 1}, "unknown sampling_params key 'bogus'"),
    ({"min_p": 0.1}, "min_p=0.1 is not supported"),
    ({"min_p": 1.5}, "min_p must be <= 1.0"),                            # SGLang's range error first
    ({"frequency_penalty": 3}, "frequency_penalty must be <= 2.0"),
    ({"presence_penalty": -2.5}, "presence_penalty must be >= -2.0"),
    ({"repetition_penalty": 0}, "repetition_penalty must be > 0.0"),
    ({"repetition_penalty": 1.2}, "not supported"),
    ({"min_new_tokens": -1}, "min_new_tokens must be >= 0"),
    ({"n": 0}, "n must be >= 1"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"structural_tag": "{}"}, "structural_tag"),
    ({"n": 1, "min_p": 0, "logit_bias": {}}, None),                      # neutral values accepted
    ({"n": 1.0}, "n must be an integer"),                                 # SGLang's i64: no floats
])
def test_sampling_keys(raw, needle):
    if needle is None:
        contract.check_sampling_keys(raw)
        return
    with pytest.raises(ContractError, match=needle):
        contract.check_sampling_keys(raw)


def test_ignored_keys_warn_once(caplog):
    contract._warned.discard("sampling_params.stream_interval")
    with caplog.at_level(logging.WARNING, "aflow_rl.serving.contract"):
        for _ in range(3):
            contract.check_sampling_keys({"stream_interval": 4})
    assert sum("stream_interval" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("value,ok", [
    (5, True), (-(2 ** 63), True), (2 ** 63 - 1, True),
    (2 ** 63, False), (10 ** 4000, False), (1e30, False), (5.0, False), (True, False), ("5", False)])
def test_integers_are_json_integers_in_int64(value, ok):
    # SGLang: _expect_int (no float, no bool) and sampling_seed in [-2**63, 2**63 - 1].
    if ok:
        assert contract.as_int(value, "sampling_seed") == value
    else:
        with pytest.raises(ContractError, match="sampling_seed"):
            contract.as_int(value, "sampling_seed")


def test_error_messages_stay_short_for_huge_values():
    for huge in (10 ** 5000, "x" * 10 ** 6, [0] * 10 ** 5):      # repr(10 ** 5000) itself raises ValueError
        with pytest.raises(ContractError) as exc:
            contract.as_int(huge, "top_k")
        assert len(str(exc.value)) < 200


@pytest.mark.parametrize("value,ok", [(0.5, True), (1.0, True), (0.0, False), (1.0001, False),
                                      (float("nan"), False), (float("inf"), False), (10 ** 400, False)])
def test_top_p_is_in_the_open_closed_unit_interval(value, ok):
    if ok:
        assert contract.as_float(value, "top_p", 0.0, 1.0, lo_open=True) == value
    else:
        with pytest.raises(ContractError, match="top_p"):
            contract.as_float(value, "top_p", 0.0, 1.0, lo_open=True)


def test_top_k():
    assert contract.top_k(-1, 100) == -1
    assert contract.top_k(0, 100) == -1
    assert contract.top_k(5, 100) == 5
    assert contract.top_k(10 ** 18, 100) == -1            # more than the vocabulary: no filter
    for bad in (-2, 1e20, 2 ** 70):
        with pytest.raises(ContractError, match="top_k"):
            contract.top_k(bad, 100)


# get_max_seq_length of SGLang 0.5.23 on each pattern (computed with that code).
SGLANG_MAX_LEN = [("abc", 3), ("a|bcd", 3), ("(ab){3}", 6), ("x{2,5}y", 6), (r"\d+", 2 ** 30), ("[a-z]?", 1),
                  ("^end$", 3), ("(?=a)b", 2 ** 30), (r"(a)\1", 2 ** 30), ("a*?", 2 ** 30), ("(?:ab|c){0,2}d", 5)]


@pytest.mark.parametrize("pattern,expected", SGLANG_MAX_LEN)
def test_regex_max_len_matches_sglang(pattern, expected):
    assert contract.regex_max_len(pattern) == expected


def test_stop_regex_limits():
    compiled, longest = contract.stop_regexes([r"\n\n", "ab|c"])
    assert [c.pattern for c in compiled] == [r"\n\n", "ab|c"] and longest == 2
    assert contract.stop_regexes(None) == ([], 0)
    with pytest.raises(ContractError, match="invalid stop_regex"):
        contract.stop_regexes("(open")
    with pytest.raises(ContractError, match="256-byte limit"):
        contract.stop_regexes("a" * 257)
    with pytest.raises(ContractError, match="at most 32"):
        contract.stop_regexes(["a"] * 33)


def test_generate_fields():
    contract.check_generate_fields({"text": "a", "image_data": None, "lora_path": None, "return_hidden_states": False,
                                    "unknown_field": 1, "priority": 3, "routing_key": "k"})
    for field, value in [("image_data", "http://x/y.png"), ("lora_path", "adapter"), ("input_embeds", [[0.1]]),
                         ("return_hidden_states", True), ("token_ids_logprob", [1, 2]),
                         ("custom_logit_processor", "x")]:
        with pytest.raises(ContractError, match=field):
            contract.check_generate_fields({"text": "a", field: value})
