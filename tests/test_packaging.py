"""What `pip install -e .` puts at the top level of site-packages: aflow_rl and workers, nothing else.

A top-level `train` (or any other generic name) could collide with another distribution's module of the
same name; train.py is a script run from the repository root, not an installed module. The check reads
top_level.txt from the metadata setuptools builds for the install (the same egg_info step pip's
editable and wheel builds run), written to a temporary directory so the checkout stays clean."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTED_TOP_LEVEL = {"aflow_rl", "workers"}


def built_top_level(tmp_path):
    proc = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"setup.py egg_info failed:\n{proc.stderr[-3000:]}"
    (info,) = [d for d in os.listdir(tmp_path) if d.endswith(".egg-info")]
    with open(tmp_path / info / "top_level.txt") as f:
        return {line.strip() for line in f if line.strip()}


def test_install_has_only_aflow_rl_and_workers_at_top_level(tmp_path):
    top = built_top_level(tmp_path)
    assert top == EXPECTED_TOP_LEVEL, f"pip install -e . would install top-level {sorted(top)}; " \
                                      f"expected only {sorted(EXPECTED_TOP_LEVEL)} (train.py stays a script)"


def test_train_script_is_not_packaged(tmp_path):
    built_top_level(tmp_path)
    (info,) = [d for d in os.listdir(tmp_path) if d.endswith(".egg-info")]
    with open(tmp_path / info / "SOURCES.txt") as f:
        sources = {line.strip() for line in f}
    assert "train.py" not in sources, "train.py is listed in the distribution's sources"
