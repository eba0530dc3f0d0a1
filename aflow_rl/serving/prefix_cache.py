"""Prefix (radix) cache of prompt KV for the embedded server's generation engine.

Requests that share a prompt prefix -- the G episodes of a group, the turns of one
episode -- reuse the key/value tensors computed for it instead of recomputing them.

The cache is a trie over fixed-size *chunks* of token ids (SGLang's radix tree with a
page size of ``chunk`` tokens): node ``j`` on a path holds the per-layer KV of tokens
``[j*chunk, (j+1)*chunk)`` and is keyed by its parent node and its own ``chunk`` token
ids, so a node is reachable only through the exact prefix it was computed for.

Why chunks, not single tokens: on CPU, attention over a query block of a different
length rounds differently (measured: logits of a suffix prefilled after a cached prefix
differ from a one-shot prefill by up to 6e-7). The engine therefore always prefills a
prompt chunk by chunk at the same absolute boundaries, with or without the cache, and
the cache stores whole chunks. Chunk ``j`` is then computed from bit-identical inputs
either way, so greedy text, token ids and logprobs are identical with the cache on or
off (tests/serving/test_prefix_cache.py).

The budget is in tokens; the least recently used chunks go first. A lookup touches the
matched path leaf-first, so an ancestor is never older than its descendants and
eviction removes leaves before the prefixes they extend (an evicted node takes its
now unreachable descendants with it).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Optional

import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]   # per layer (keys, values), each [1, H_kv, chunk, D]


class _Node:
    __slots__ = ("id", "key", "layers", "children")

    def __init__(self, node_id: int, key: tuple, layers: Layers):
        self.id, self.key, self.layers = node_id, key, layers
        self.children: set[tuple] = set()


class PrefixCache:
    """Chunk-granular KV trie with a token budget and LRU eviction (single-threaded: the engine thread).

    Args:
        chunk: tokens per node; prompts are prefilled at multiples of it.
        max_tokens: most tokens held (``chunk`` per node); 0 keeps nothing.
    """

    def __init__(self, chunk: int = 32, max_tokens: int = 65536):
        if chunk < 1:
            raise ValueError(f"prefix cache chunk must be >= 1 token, got {chunk}")
        if max_tokens < 0:
            raise ValueError(f"prefix cache budget must be >= 0 tokens, got {max_tokens}")
        self.chunk, self.max_tokens = int(chunk), int(max_tokens)
        self._nodes: OrderedDict[tuple, _Node] = OrderedDict()   # least recently used first
        self._ids = itertools.count(1)                             # 0 is the root
        self.evicted_tokens = 0

    @property
    def tokens(self) -> int:
        """Tokens whose KV the cache holds now."""
        return len(self._nodes) * self.chunk

    def _key(self, parent: int, ids: list[int], j: int) -> tuple:
        return parent, tuple(ids[j * self.chunk:(j + 1) * self.chunk])

    def match(self, ids: list[int], max_chunks: int) -> list[Layers]:
        """KV of the longest cached chunk-aligned prefix of ``ids``, at most ``max_chunks`` chunks."""
        path: list[_Node] = []
        parent = 0
        for j in range(min(max_chunks, len(ids) // self.chunk)):
            node = self._nodes.get(self._key(parent, ids, j))
            if node is None:
                break
            path.append(node)
            parent = node.id
        self._touch(path)
        return [node.layers for node in path]

    def insert(self, ids: list[int], j: int, layers: Layers) -> None:
        """Store the KV of chunk ``j`` of ``ids`` (its chunks ``< j`` must be cached or just inserted)."""
        if self.max_tokens < self.chunk or len(ids) < (j + 1) * self.chunk:
            return
        path: list[_Node] = []
        parent = 0
        for i in range(j):
            node = self._nodes.get(self._key(parent, ids, i))
            if node is None:   # the prefix was evicted meanwhile: this chunk would be unreachable
                return
            path.append(node)
            parent = node.id
        key = self._key(parent, ids, j)
        if key not in self._nodes:
            node = _Node(next(self._ids), key, layers)
            self._nodes[key] = node
            if path:
                path[-1].children.add(key)
            path.append(node)
        else:
            path.append(self._nodes[key])
        self._touch(path)
        self._evict()

    def flush(self) -> int:
        """Drop everything (``/flush_cache``, weight updates); returns the tokens dropped."""
        dropped = self.tokens
        self._nodes.clear()
        return dropped

    def _touch(self, path: list[_Node]) -> None:
        for node in reversed(path):          # leaf first: the root ends up most recent
            self._nodes.move_to_end(node.key)

    def _evict(self) -> None:
        while self._nodes and self.tokens > self.max_tokens:
            _, node = self._nodes.popitem(last=False)
            self.evicted_tokens += self.chunk
            self._drop_children(node)

    def _drop_children(self, node: _Node) -> None:
        stack = list(node.children)
        while stack:
            child: Optional[_Node] = self._nodes.pop(stack.pop(), None)
            if child is not None:
                self.evicted_tokens += self.chunk
                stack.extend(child.children)
