"""SGLang 0.5.x's request contract as the embedded server keeps it: field types, ranges, and
what the server does with every ``sampling_params`` key and ``/generate`` field SGLang accepts.

SGLang checks a ``/generate`` body twice (``sglang.api.v1.api_types.decode_GenerateRequest``
then ``SamplingParams.verify``/``normalize`` in ``sglang/srt/sampling/sampling_params.py``):

- unknown ``sampling_params`` keys are rejected, unknown top-level fields ignored;
- integers must be JSON integers (``5.0`` and ``1e20`` are refused), booleans booleans;
- ``temperature >= 0`` and finite, ``top_p`` in (0, 1], ``min_p`` in [0, 1], ``top_k`` -1 or >= 1,
  penalties in [-2, 2], ``repetition_penalty`` in (0, 2], ``0 <= min_new_tokens <= max_new_tokens``,
  ``sampling_seed`` in [-2**63, 2**63 - 1], at most 32 stop strings and 32 ``stop_regex``
  patterns of at most 256 bytes, at most one of json_schema / regex / ebnf / structural_tag.

Each key SGLang accepts is in exactly one of three sets here: implemented; accepted only at
its neutral value (it would change the output and the embedded server cannot do it: 400 naming
the key otherwise); or ignored with a one-time warning (it cannot change what the server returns).
"""
from __future__ import annotations

import logging
import math
import re
from typing import Any, Optional

try:                                   # Python 3.11+: sre_parse is deprecated
    import re._parser as sre_parse     # type: ignore[import-not-found]
except ImportError:                    # pragma: no cover
    import sre_parse                   # type: ignore[no-redef]

log = logging.getLogger("aflow_rl.serving.contract")

I64_MIN, I64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_STOP_COUNT = 32                    # SGLang's MAX_STOP_COUNT
MAX_STOP_REGEX_COUNT = 32              # SGLang's MAX_STOP_REGEX_COUNT
MAX_STOP_REGEX_LEN = 256               # bytes, SGLang's MAX_STOP_REGEX_LEN

SAMPLING_IMPLEMENTED = frozenset({
    "max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "stop_regex", "ignore_eos",
    "json_schema", "regex", "ebnf", "skip_special_tokens", "no_stop_trim", "sampling_seed",
    "spaces_between_special_tokens"})
# Would change the output; accepted only at the value that changes nothing.
SAMPLING_NEUTRAL: dict[str, tuple] = {
    "min_p": (0.0,), "frequency_penalty": (0.0,), "presence_penalty": (0.0,), "repetition_penalty": (1.0,),
    "min_new_tokens": (0,), "n": (1,), "beam_width": (None, 1), "structural_tag": (None, ""),
    "logit_bias": (None, {}), "watermark": (None,), "choice": (None, [])}
# Cannot change a non-streamed result: stream_interval paces streamed chunks; custom_params only
# feed a custom_logit_processor, which the server refuses (see GENERATE_NEUTRAL).
SAMPLING_IGNORED = frozenset({"stream_interval", "custom_params"})
SAMPLING_KEYS = SAMPLING_IMPLEMENTED | set(SAMPLING_NEUTRAL) | SAMPLING_IGNORED

GENERATE_IMPLEMENTED = frozenset({
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "stream"})
# /generate fields that would change the reply; the server cannot honour them.
GENERATE_NEUTRAL: dict[str, tuple] = {
    "input_embeds": (None,), "image_data": (None, []), "video_data": (None, []), "audio_data": (None, []),
    "token_ids_logprob": (None, []), "return_hidden_states": (None, False), "lora_path": (None,),
    "lora_id": (None,), "session_params": (None,), "custom_logit_processor": (None,),
    "require_reasoning": (None, False), "max_thinking_tokens": (None,), "return_prompt_token_ids": (None, False),
    "return_sampling_mask": (None, False), "return_routed_experts": (None, False), "return_entropy": (None, False),
    "return_bytes": (None, False), "return_flat_raw_top_logprobs": (None, False),
    "return_flat_raw_output_top_logprobs": (None, False), "images_config": (None,)}
# Routing, scheduling, disaggregation, caching namespaces and logging: no effect on one server's reply.
GENERATE_IGNORED = frozenset({
    "session_id", "routing_key", "priority", "extra_key", "cache_salt", "custom_labels", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
    "disagg_prefill_dp_rank", "data_parallel_rank", "kv_hints", "log_metrics", "no_logs", "conversation_id",
    "external_trace_header", "received_time", "modalities", "mm_hashes", "routed_experts_start_len",
    "background", "use_audio_in_video", "video_config", "mm_processor_kwargs"})

_warned: set[str] = set()


class ContractError(ValueError):
    """A request that breaks SGLang's contract; the HTTP layer answers 400 with the message."""


def fail(message: str) -> None:
    raise ContractError(message)


def warn_once(what: str) -> None:
    """Log ``what`` is ignored, once per process (a per-request warning would flood the log)."""
    if what not in _warned:
        _warned.add(what)
        log.warning("%s is accepted and ignored by the embedded server: it cannot change the reply", what)


# ---- scalar checks (SGLang's JSON contract: no coercion) -----------------------------------------------

def as_int(value: Any, name: str, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """A JSON integer within [lo, hi] (and always within int64, as SGLang's i64 fields)."""
    if isinstance(value, bool) or not isinstance(value, int):
        fail(f"{name} must be an integer, got {_show(value)}")
    lo = I64_MIN if lo is None else lo
    hi = I64_MAX if hi is None else hi
    if value < lo:
        fail(f"{name} must be >= {lo}, got {_show(value)}")
    if value > hi:
        fail(f"{name} must be <= {hi}, got {_show(value)}")
    return value


def as_float(value: Any, name: str, lo: Optional[float] = None, hi: Optional[float] = None,
             lo_open: bool = False) -> float:
    """A finite JSON number within [lo, hi] (or (lo, hi] with ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(f"{name} must be a number, got {_show(value)}")
    try:
        value = float(value)
    except OverflowError:                       # a 400-digit integer
        fail(f"{name} must be a finite number, got {_show(value)}")
    if not math.isfinite(value):
        fail(f"{name} must be a finite number, got {value}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        fail(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        fail(f"{name} must be <= {hi}, got {value}")
    return value


def as_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        fail(f"{name} must be true or false, got {_show(value)}")
    return value


def str_list(value: Any, name: str, max_count: int) -> list[str]:
    """A string or a list of strings (empty strings dropped), at most ``max_count``."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        fail(f"{name} must be a string or a list of strings, got {_show(value)}")
    if len(value) > max_count:
        fail(f"at most {max_count} {name} entries are allowed, got {len(value)}")
    return [s for s in value if s]


def _show(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"     # repr of a 5000-digit int raises
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + f"... ({len(text)} chars)"


# ---- sampling_params keys ----------------------------------------------------------------------------

def check_sampling_keys(raw: dict) -> None:
    """Unknown keys -> 400 (as SGLang); unsupported non-neutral values -> 400; ignored keys -> warning."""
    for key, value in raw.items():
        if key in SAMPLING_IMPLEMENTED:
            continue
        if key in SAMPLING_IGNORED:
            if value is not None:
                warn_once(f"sampling_params.{key}")
            continue
        if key in SAMPLING_NEUTRAL:
            _check_neutral_range(key, value)
            if value not in SAMPLING_NEUTRAL[key]:
                fail(f"sampling_params.{key}={_show(value)} is not supported by the embedded server "
                     f"(only {SAMPLING_NEUTRAL[key][0]!r})")
            continue
        fail(f"unknown sampling_params key {key!r}; SGLang's keys are {sorted(SAMPLING_KEYS)}")


def _check_neutral_range(key: str, value: Any) -> None:
    """SGLang's range errors come first, so a bad value is reported as SGLang reports it."""
    if value is None:
        return
    if key == "min_p":
        as_float(value, key, 0.0, 1.0)
    elif key in ("frequency_penalty", "presence_penalty"):
        as_float(value, key, -2.0, 2.0)
    elif key == "repetition_penalty":
        as_float(value, key, 0.0, 2.0, lo_open=True)
    elif key in ("min_new_tokens", "n"):
        as_int(value, key, lo=0 if key == "min_new_tokens" else 1)
    elif key == "beam_width":
        as_int(value, key, lo=1)


def top_k(value: Any, vocab_size: int) -> int:
    """SGLang's top_k: -1 (or unset) is the whole vocabulary, else >= 1; clamped to the vocabulary.

    0 is read as -1 (SGLang refuses it; OpenAI-style clients send it meaning "off").
    """
    k = as_int(value, "top_k")
    if k in (-1, 0):
        return -1
    if k < 1:
        fail(f"top_k must be -1 (disable) or at least 1, got {k}")
    return -1 if k >= vocab_size else k


def stop_regexes(value: Any) -> tuple[list[re.Pattern], int]:
    """Compiled ``stop_regex`` patterns and the longest text (in characters) one can match.

    The bound says how much decoded tail must be searched after each token (SGLang's
    ``get_max_seq_length``); an unbounded pattern (``.*``) needs the whole output.
    """
    patterns = str_list(value, "stop_regex", MAX_STOP_REGEX_COUNT)
    compiled, longest = [], 0
    for p in patterns:
        size = len(p.encode("utf-8"))
        if size > MAX_STOP_REGEX_LEN:
            fail(f"stop_regex is {size} bytes, over the {MAX_STOP_REGEX_LEN}-byte limit")
        try:
            compiled.append(re.compile(p))
            longest = max(longest, regex_max_len(p))
        except (re.error, RecursionError, OverflowError) as exc:
            fail(f"invalid stop_regex {p!r}: {exc}")
    return compiled, longest


UNBOUNDED = 2 ** 30


def regex_max_len(pattern: str) -> int:
    """Upper bound on the characters a match of ``pattern`` spans (SGLang's get_max_seq_length).

    Same rules as SGLang's, except that a negated literal (``[^x]`` of one char) counts 1
    where SGLang's falls back to unbounded.
    """
    return min(_max_len(sre_parse.parse(pattern)), UNBOUNDED)


def _max_len(sub) -> int:
    total = 0
    for token, value in sub:
        if token in (sre_parse.LITERAL, sre_parse.NOT_LITERAL, sre_parse.IN, sre_parse.ANY):
            total += 1
        elif token == sre_parse.SUBPATTERN:
            total += _max_len(value[-1])
        elif token == sre_parse.BRANCH:
            total += max(_max_len(b) for b in value[1])
        elif token in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, getattr(sre_parse, "POSSESSIVE_REPEAT", None)):
            _, hi, inner = value
            total += UNBOUNDED if hi == sre_parse.MAXREPEAT else hi * _max_len(inner)
        elif token == sre_parse.AT:
            continue                                   # ^, $, \b: zero-width
        else:
            total += UNBOUNDED                         # look-arounds, back-references: assume anything
        total = min(total, UNBOUNDED)
    return total


# ---- /generate top-level fields ---------------------------------------------------------------------

def check_generate_fields(body: dict) -> None:
    """Fields SGLang accepts that the server cannot honour -> 400; those that change nothing -> warning.

    Unknown top-level fields are ignored, as SGLang ignores them.
    """
    for key, value in body.items():
        if key in GENERATE_IMPLEMENTED:
            continue
        if key in GENERATE_NEUTRAL:
            if value not in GENERATE_NEUTRAL[key]:
                fail(f"{key} is not supported by the embedded server (a text-only model without adapters)")
        elif key in GENERATE_IGNORED and value not in (None, False, {}, []):
            warn_once(key)
