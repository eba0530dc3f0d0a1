"""Grammar-constrained decoding with xgrammar, shared by the embedded server and the trainer.

The server compiles a request's ``json_schema`` or ``regex`` once, gives every
sequence its own ``GrammarMatcher`` and masks the logits before each token. The
trainer must rebuild exactly the same masks to recompute the server's logprobs
(log-softmax of the temperature-scaled logits *after* the mask), so both sides go
through :class:`GrammarBackend` and :func:`grammar_masks`.

    backend = GrammarBackend.from_pretrained("models/tiny")
    masks = grammar_masks({"json_schema": schema}, response_ids, backend=backend)   # BoolTensor [T, V]

JSON is compiled without free whitespace by default (xgrammar's ``any_whitespace=False``,
SGLang's ``--constrained-json-disable-any-whitespace``): a small or random policy would
otherwise spend its token budget on spaces. Pass ``any_whitespace=True`` on both sides
to get SGLang's default instead.
"""
from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence, Union

import torch
import xgrammar as xgr

# Characters a JSON string never holds raw: controls, and surrogates (invalid in UTF-8).
_NOT_IN_JSON_STRINGS = r"\0-\x1f\uD800-\uDFFF"
# Bit k of int32 word w in an xgrammar bitmask says whether token 32*w + k is allowed.
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """An invalid ``json_schema`` or ``regex``; the message is the compiler's."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: ``kind`` is ``json_schema``, ``regex`` or ``ebnf``."""

    kind: str
    value: str

    def to_dict(self) -> dict[str, str]:
        """The form a Trajectory stores: ``{"json_schema": "..."}`` or ``{"regex": "..."}``."""
        return {self.kind: self.value}


GrammarLike = Union[GrammarSpec, Mapping[str, Any], "xgr.CompiledGrammar"]


_GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


def spec_from_params(params: Mapping[str, Any] | None) -> GrammarSpec | None:
    """Read ``json_schema`` / ``regex`` / ``ebnf`` from SGLang sampling params (or a stored spec dict).

    A ``json_schema`` may be a JSON string (SGLang's form) or an already parsed dict; an
    empty string means unset, as in SGLang. Raises :class:`GrammarError` when more than
    one is set or a value has the wrong type.
    """
    if not params:
        return None
    given = {k: params.get(k) for k in _GRAMMAR_KINDS if params.get(k) not in (None, "")}
    if len(given) > 1:
        raise GrammarError(f"set only one of json_schema, regex and ebnf (got {', '.join(given)})")
    if not given:
        return None
    kind, value = next(iter(given.items()))
    if kind == "json_schema" and isinstance(value, (dict, bool)):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise GrammarError(f"{kind} must be a {'JSON ' if kind == 'json_schema' else ''}string, "
                           f"got {type(value).__name__}")
    return GrammarSpec(kind, value)


class GrammarBackend:
    """xgrammar compiler for one tokenizer/vocabulary, with its compile cache.

    ``vocab_size`` is the model's (``config.vocab_size``, the logits width), which may
    exceed the tokenizer's; the extra ids are never allowed.
    """

    def __init__(self, tokenizer, vocab_size: int, *, stop_token_ids: Sequence[int] | None = None,
                 any_whitespace: bool = False, max_threads: int = 2, cache_size: int = 256):
        self.vocab_size = int(vocab_size)
        # Compiled grammars by (kind, text): the agent's requests repeat a handful of schemas, and
        # from_json_schema + the strict-strings rewrite + compile took 11% of the server's time.
        self.cache = CompiledCache(cache_size)
        self.any_whitespace = any_whitespace
        stop = sorted(set(int(t) for t in stop_token_ids)) if stop_token_ids else None
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                                 stop_token_ids=stop)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=True)

    @classmethod
    def from_pretrained(cls, model_path: str, *, any_whitespace: bool = False) -> "GrammarBackend":
        """Backend for a Hugging Face model directory (tokenizer, vocab size and eos ids from it)."""
        return _cached_backend(model_path, any_whitespace)

    def compile(self, grammar: GrammarLike) -> "xgr.CompiledGrammar":
        """Compile a spec, or take it from the LRU cache; raises :class:`GrammarError` with the compiler's message."""
        if isinstance(grammar, xgr.CompiledGrammar):
            return grammar
        spec = grammar if isinstance(grammar, GrammarSpec) else spec_from_params(grammar)
        if spec is None:
            raise GrammarError("no json_schema, regex or ebnf given")
        compiled = self.cache.get(spec)
        if compiled is None:
            compiled = self.compile_uncached(spec)
            self.cache.put(spec, compiled)
        return compiled

    def compile_uncached(self, spec: GrammarSpec) -> "xgr.CompiledGrammar":
        """Compile ``spec`` now, bypassing the cache (the server adds a deadline around this)."""
        try:
            if spec.kind == "json_schema":
                grammar = xgr.Grammar.from_json_schema(spec.value, any_whitespace=self.any_whitespace)
                return self.compiler.compile_grammar(strict_json_strings(str(grammar)))
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.value)
            if spec.kind == "ebnf":
                return self.compiler.compile_grammar(spec.value)
        except Exception as exc:  # xgrammar raises RuntimeError / InvalidJSONError with the reason
            raise GrammarError(f"invalid {spec.kind}: {exc}") from exc
        raise GrammarError(f"unknown grammar kind {spec.kind!r}; use json_schema, regex or ebnf")

    def matcher(self, compiled: "xgr.CompiledGrammar") -> "xgr.GrammarMatcher":
        """A fresh per-sequence matcher; it terminates once it accepts a stop token."""
        return xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """An int32 bitmask ``[rows, ceil(V/32)]`` for ``fill_next_token_bitmask``."""
        return xgr.allocate_token_bitmask(rows, self.vocab_size)


class CompiledCache:
    """A thread-safe bounded LRU of compiled grammars keyed by :class:`GrammarSpec`, with hit counters.

    Failed compilations are not cached (they raise before ``put``); the lock guards only the
    dictionary, so two threads missing on the same spec may both compile it once.
    """

    def __init__(self, capacity: int):
        self.capacity = max(0, int(capacity))
        self.hits = self.misses = 0
        self._items: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, spec: GrammarSpec) -> Any:
        with self._lock:
            compiled = self._items.get(spec)
            if compiled is None:
                self.misses += 1
                return None
            self._items.move_to_end(spec)
            self.hits += 1
            return compiled

    def put(self, spec: GrammarSpec, compiled: Any) -> None:
        with self._lock:
            if self.capacity == 0:
                return
            self._items[spec] = compiled
            self._items.move_to_end(spec)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "size": len(self._items), "capacity": self.capacity}

    def __len__(self) -> int:
        return len(self._items)


def strict_json_strings(ebnf: str) -> str:
    r"""Make every negated character class of a JSON grammar exclude what JSON strings cannot hold.

    Two gaps in xgrammar 0.2.8 let a sampler produce output that ``json.loads`` or a
    schema validator then rejects: length-bounded strings (``maxLength``) are written
    as ``[^"\\\r\n]{0,k}``, admitting raw control characters U+0000-U+001F; and every
    string admits UTF-8-encoded surrogates (``\xed\xa0\x80``-``\xed\xbf\xbf``), which
    are invalid UTF-8 and decode to three replacement characters (breaking ``maxLength``).
    Negated classes in xgrammar's JSON grammars only ever describe string contents,
    so each gets ``\0-\x1f\uD800-\uDFFF`` added; quoted literals (enum values) are
    left untouched.
    """
    out, i, n = [], 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c == '"':                                   # a literal: copy through its closing quote
            j = i + 1
            while j < n and ebnf[j] != '"':
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
        elif c == "[":                                 # a character class: copy through its ']'
            j = i + 1
            while j < n and ebnf[j] != "]":
                j += 2 if ebnf[j] == "\\" else 1
            cls = ebnf[i:j + 1]
            if cls.startswith("[^"):
                cls = "[^" + _NOT_IN_JSON_STRINGS + cls[2:]
            out.append(cls)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


@functools.lru_cache(maxsize=8)
def _cached_backend(model_path: str, any_whitespace: bool) -> GrammarBackend:
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    config = AutoConfig.from_pretrained(model_path)
    return GrammarBackend(tok, config.vocab_size, stop_token_ids=eos_token_ids(model_path, tok, config),
                          any_whitespace=any_whitespace)


def eos_token_ids(model_path: str | None, tokenizer, config) -> list[int]:
    """Every id that ends a generation: the tokenizer's eos, config's and generation_config's."""
    ids: set[int] = set()

    def add(value):
        if value is None:
            return
        if isinstance(value, int):
            ids.add(value)
        else:
            ids.update(int(v) for v in value)

    add(getattr(tokenizer, "eos_token_id", None))
    add(getattr(config, "eos_token_id", None))
    if model_path is not None:
        try:
            from transformers import GenerationConfig

            add(GenerationConfig.from_pretrained(model_path).eos_token_id)
        except (OSError, ValueError):
            pass  # no generation_config.json: the tokenizer/config ids are all there is
    return sorted(ids)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask ``[N, W]`` -> allowed-token mask ``BoolTensor [N, vocab_size]``."""
    bits = (bitmask.unsqueeze(-1) >> _BIT_SHIFTS.to(bitmask.device)) & 1          # [N, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def mask_logits_(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Set disallowed logits to -inf in place (``logits`` and ``allowed`` are ``[N, V]``)."""
    return logits.masked_fill_(~allowed, float("-inf"))


def grammar_bitmasks(grammar: GrammarLike, response_ids: Iterable[int], *, backend: GrammarBackend) -> torch.Tensor:
    """Packed masks before each response token: int32 ``[T, ceil(V/32)]`` (see :func:`grammar_masks`)."""
    ids = [int(t) for t in response_ids]
    matcher = backend.matcher(backend.compile(grammar))
    out = backend.allocate_bitmask(len(ids))
    for t, token in enumerate(ids):
        if matcher.is_terminated():
            raise ValueError(f"response continues after the grammar terminated (position {t}, token {token})")
        matcher.fill_next_token_bitmask(out, t)
        if not matcher.accept_token(token):
            raise ValueError(f"token {token} at position {t} is not allowed by the grammar")
    return out


def grammar_masks(grammar: GrammarLike, response_ids: Iterable[int], *, backend: GrammarBackend) -> torch.Tensor:
    """Allowed-token masks the server applied before each response token: ``BoolTensor [T, V]``.

    ``grammar`` is a :class:`GrammarSpec`, a stored spec dict (``{"json_schema": ...}``
    or ``{"regex": ...}``) or a compiled grammar; ``V`` is ``backend.vocab_size``. Row
    ``t`` is the mask in force when ``response_ids[t]`` was sampled, so
    ``log_softmax(logits[t].masked_fill(~mask[t], -inf) / temperature)`` reproduces the
    server's logprob. Raises ``ValueError`` if the response violates the grammar.
    """
    return unpack_bitmask(grammar_bitmasks(grammar, response_ids, backend=backend), backend.vocab_size)
