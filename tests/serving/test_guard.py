"""API-key rules (SGLang's decide_request_auth) and the prompt byte bound."""
import itertools
import json
import os
import subprocess
import sys

import pytest

from aflow_rl.serving.guard import ADMIN_PATHS, allowed, prompt_bytes_bound

KEYS = [None, "user"]
ADMIN_KEYS = [None, "admin"]
HEADERS = [None, "Bearer user", "Bearer admin", "bearer user", "user", "Bearer wrong", "Basic user"]
PATHS = ["/generate", "/v1/chat/completions", "/health", "/health_generate", "/update_weights_from_disk",
         "/flush_cache", "/abort_request"]

# (method, path, header, api_key, admin_api_key) -> allowed, read off sglang/srt/utils/auth.py (0.5.23).
CASES = [
    ("POST", "/generate", None, None, None, True),                      # no keys: open
    ("POST", "/generate", None, "user", None, False),
    ("POST", "/generate", "Bearer user", "user", None, True),
    ("POST", "/generate", "bearer user", "user", None, True),           # scheme is case-insensitive
    ("POST", "/generate", "user", "user", None, False),                 # no scheme
    ("POST", "/generate", "Bearer admin", "user", "admin", False),      # admin key is not the API key
    ("POST", "/generate", None, None, "admin", True),                   # admin key alone guards admin routes only
    ("GET", "/health", None, "user", "admin", True),                    # probes never need a key
    ("GET", "/health_generate", None, "user", None, True),
    ("OPTIONS", "/generate", None, "user", None, True),
    ("POST", "/update_weights_from_disk", None, None, None, True),
    ("POST", "/update_weights_from_disk", "Bearer user", "user", None, True),    # api key guards admin routes
    ("POST", "/update_weights_from_disk", "Bearer user", "user", "admin", False),
    ("POST", "/update_weights_from_disk", "Bearer admin", "user", "admin", True),
    ("POST", "/update_weights_from_disk", None, None, "admin", False),
    ("POST", "/flush_cache", "Bearer admin", None, "admin", True),
]


@pytest.mark.parametrize("method,path,header,key,admin,expected", CASES)
def test_auth_decisions(method, path, header, key, admin, expected):
    assert allowed(method, path, header, key, admin) is expected


def test_auth_matches_sglang_on_every_combination():
    from tests.serving.sglang_reference import import_problem

    problem = import_problem()
    if problem:
        pytest.skip(problem)
    cases = [(p, h, k, a, p in ADMIN_PATHS) for p, h, k, a in itertools.product(PATHS, HEADERS, KEYS, ADMIN_KEYS)]
    script = os.path.join(os.path.dirname(__file__), "sglang_reference.py")
    proc = subprocess.run([sys.executable, script, "auth"], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(theirs) == len(cases)
    for (path, header, key, admin, _), expected in zip(cases, theirs):
        assert allowed("POST", path, header, key, admin) is expected, (path, header, key, admin)


def test_prompt_bytes_bound_never_refuses_a_prompt_that_fits(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    context = 64
    bound = prompt_bytes_bound(tok, context)
    # The densest text: the longest token repeated; it must fit under the bound for `context` tokens.
    longest = max(range(len(tok)), key=lambda i: len(tok.decode([i]).encode("utf-8")))
    dense = tok.decode([longest] * context)
    assert len(tok.encode(dense, add_special_tokens=False)) <= context
    assert len(dense.encode("utf-8")) <= bound
    # And a text over the bound really has more tokens than the context.
    sparse = "a" * (bound + 1)
    assert len(tok.encode(sparse, add_special_tokens=False)) > context
