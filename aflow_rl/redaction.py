"""Redaction of secrets in a config before it is written anywhere (``run.dir/config.yaml``).

A secret can hide in four places of a config, and each has its own rule:

- a mapping key named like a secret (``api_key``, ``hf_token``, ``db_password``; not
  ``api_key_env``, which names an environment variable, not its value);
- command-line arguments (``serving.*.extra_args``): the value after a key-like flag, as
  two list items (``["--api-key", "sk-1"]``) or one (``"--api-key=sk-1"``, ``"--api-key sk-1"``);
- URL query parameters named like keys or tokens (``?api_key=sk-1&model=x``);
- the password of a URL's user information (``https://user:pw@host``).

A redacted value becomes ``***``; everything else is kept, so the file still loads.
"""
from __future__ import annotations

import re
from typing import Any

MASK = "***"

# A name is secret-like when its last component (after -, _ or .) is one of these words;
# "max_tokens" or "tokenizer" are not ("tokens" and "tokenizer" are other words).
_SECRET_WORD = re.compile(
    r"(?:^|[-_.])(?:key|apikey|token|secret|password|passwd|pwd|passphrase|credentials?|auth|sig|signature)$"
    r"|(?:apikey|accesstoken|authtoken|secretkey|privatekey)$", re.I)

# NAME=value, with NAME a flag (--api-key=), a query parameter (?api_key=) or a variable (HF_TOKEN=).
_ASSIGN = re.compile(r"(?P<name>(?<![\w.-])-{0,2}[A-Za-z0-9_.-]+)=(?P<value>[^&#\s]+)")
# --flag value inside one string.
_FLAG_SPACE = re.compile(r"(?P<name>(?<![\w-])--?[A-Za-z0-9_.-]+)(?P<sep>\s+)(?P<value>[^-\s]\S*)")
# scheme://user:password@host; the password runs to the last @ before the path (as urllib splits it).
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/?#@:\s]*:)(?P<pw>[^/?#\s]+)@")


def secret_name(name: str) -> bool:
    """Whether a key, flag or parameter name says its value is a secret."""
    return bool(_SECRET_WORD.search(name.lstrip("-")))


def redact_text(text: str) -> str:
    """A string with every secret it carries replaced by ``***``."""
    text = _USERINFO.sub(lambda m: m["head"] + MASK + "@", text)
    text = _ASSIGN.sub(lambda m: f"{m['name']}={MASK}" if secret_name(m["name"]) else m[0], text)
    return _FLAG_SPACE.sub(lambda m: m["name"] + m["sep"] + MASK if secret_name(m["name"]) else m[0], text)


def _redact_args(items: list) -> list:
    """A list; a string item right after a bare key-like flag (``--api-key``) is its value."""
    out = []
    for i, item in enumerate(items):
        prev = items[i - 1] if i else None
        if (isinstance(item, str) and isinstance(prev, str) and prev.startswith("-") and "=" not in prev
                and secret_name(prev) and not item.startswith("-")):
            out.append(MASK)
        else:
            out.append(redact(item))
    return out


def redact(data: Any, key: str = "") -> Any:
    """``data`` (nested dicts, lists, strings) with secrets replaced by ``***``."""
    if isinstance(data, dict):
        return {k: redact(v, str(k)) for k, v in data.items()}
    if isinstance(data, list):
        return _redact_args(data)
    if isinstance(data, str):
        if data and secret_name(key):
            return MASK
        return redact_text(data)
    return data
