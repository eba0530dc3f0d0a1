"""Hostile configs (issue 14): each finding is a one-line ConfigError at load time, or a redaction.

Before the fix: duplicate YAML keys were merged silently, group_size=1 / episode_timeout_s=-1
trained nothing and exited 0, save_every=0 crashed after step 1, lr=.nan gave a traceback,
resume=/nonexistent and a run.dir that is a file failed late with tracebacks, the tab error lost
its line, and secrets in extra_args or a base_url query were written in clear to run.dir/config.yaml.
"""
import os

import pytest
import yaml

from aflow_rl.config import Config, ConfigError, _duration_keys, load_config, redact, save_resolved


def load_error(*overrides, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def write(tmp_path, text: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


# --- duplicate keys ------------------------------------------------------------------------------

def test_duplicate_top_level_key_names_key_and_both_lines(tmp_path):
    path = write(tmp_path, "trainer:\n  lr: 1.0e-3\nrollout:\n  workers: 2\ntrainer:\n  max_steps: 3\n")
    msg = load_error(path=path)
    assert "duplicate key 'trainer'" in msg and f"{path}:5:" in msg and "first at line 1" in msg


@pytest.mark.parametrize("text, key, line, first", [
    ("env:\n  swarm:\n    suite: wide\n    max_items: 4\n    suite: deep\n", "env.swarm.suite", 5, 3),
    ("trainer: {lr: 1.0e-5, lr: 2.0e-5}\n", "trainer.lr", 1, 1),
    ("rollout:\n  workers: 2\n  workers: 2\n", "rollout.workers", 3, 2),     # equal values too
    ("env:\n  swarm:\n    item_range:\n      wide: [1, 2]\n      wide: [3, 4]\n", "env.swarm.item_range.wide", 5, 4),
])
def test_duplicate_nested_keys(tmp_path, text, key, line, first):
    msg = load_error(path=write(tmp_path, text))
    assert f"duplicate key '{key}'" in msg and f":{line}:" in msg and f"first at line {first}" in msg


def test_merge_key_override_is_not_a_duplicate(tmp_path):
    path = write(tmp_path, "serving:\n  policy: &srv {backend: embedded, threads: 1}\n"
                           "  actor:\n    <<: *srv\n    threads: 2\n")
    cfg = load_config(path)
    assert cfg.serving.policy.threads == 1 and cfg.serving.actor.threads == 2


# --- YAML syntax errors keep line and column -----------------------------------------------------

def test_tab_error_keeps_line_and_column(tmp_path):
    path = write(tmp_path, "run:\n  name: x\ntrainer:\n\tlr: 1\n")
    msg = load_error(path=path)
    assert msg.startswith(f"{path}:4:1: not valid YAML") and "tabs" in msg


def test_unclosed_bracket_keeps_line_and_column(tmp_path):
    path = write(tmp_path, "rollout:\n  workers: 2\ntrainer: {lr: 1\n")
    msg = load_error(path=path)
    assert msg.startswith(f"{path}:4:1: not valid YAML") and "expected ','" in msg


# --- values that train nothing or crash later ----------------------------------------------------

@pytest.mark.parametrize("size", [1, 0, -3])
def test_group_size_below_two(size):
    msg = load_error(f"rollout.group_size={size}")
    assert f"rollout.group_size: must be at least 2, got {size}" in msg and "zero advantage" in msg
    assert load_config(None, ["rollout.group_size=2"]).rollout.group_size == 2


def test_every_duration_key_is_found_from_the_dataclasses():
    keys = set(_duration_keys())
    assert {"rollout.episode_timeout_s", "rollout.start_timeout_s", "rollout.timeout_grace_s",
            "serving.policy.startup_timeout_s", "serving.actor.stop_grace_s", "llm.actor.timeout_s",
            "llm.policy.backoff_s", "env.swarm.max_wall_s", "env.plan_act.timeout_s",
            "env.aflow.problem_timeout_s", "env.aflow.code_timeout_s", "trainer.sync_timeout_s"} <= keys


@pytest.mark.parametrize("key", _duration_keys())
def test_durations_reject_negative_and_limits_reject_zero(key):
    msg = load_error(f"{key}=-1")
    assert msg.startswith(f"{key}: must be") and "got -1" in msg
    if key.endswith(("timeout_s", "wall_s")):
        assert "positive" in load_error(f"{key}=0")
    else:  # a pause of 0 is legitimate: no grace, no backoff
        assert load_config(None, [f"{key}=0"])


def test_episode_timeout_names_value_and_default():
    msg = load_error("rollout.episode_timeout_s=-1")
    assert msg == ("rollout.episode_timeout_s: must be a positive number of seconds, got -1 (default 300); "
                   "a limit of 0 or less fails everything at once")


@pytest.mark.parametrize("key", ["trainer.save_every", "trainer.sync_every", "trainer.log_every",
                                 "trainer.sample_every", "trainer.ppo_epochs", "trainer.micro_batch_size",
                                 "trainer.grad_accum"])
@pytest.mark.parametrize("value", [0, -1])
def test_step_intervals_and_batch_sizes_at_least_one(key, value):
    assert load_error(f"{key}={value}").startswith(f"{key}: must be at least 1, got {value}")


def test_save_every_hint_and_large_value_still_loads():
    assert "save_every >= trainer.max_steps saves only at the end" in load_error("trainer.save_every=0")
    assert load_config(None, ["trainer.save_every=1000"]).trainer.save_every == 1000


@pytest.mark.parametrize("override", ["trainer.lr=.nan", "trainer.lr=.inf", "trainer.lr=-.inf", "trainer.lr=1e400",
                                      "trainer.lr=" + "9" * 400, "trainer.betas=[0.9, .nan]",
                                      "algo.clip_high=.NaN", "env.temperature=.inf"])
def test_non_finite_numbers(override):
    key = override.split("=")[0]
    msg = load_error(override)
    assert msg.startswith(key) and "finite number" in msg


def test_non_finite_number_in_yaml_file(tmp_path):
    assert "trainer.lr: must be a finite number, got nan" in load_error(path=write(tmp_path, "trainer:\n  lr: .nan\n"))


@pytest.mark.parametrize("lr", ["0", "-1e-5"])
def test_learning_rate_must_be_positive(lr):
    assert load_error(f"trainer.lr={lr}").startswith("trainer.lr: must be positive")


# --- paths ---------------------------------------------------------------------------------------

def test_resume_path_must_exist(tmp_path):
    missing = str(tmp_path / "nonexistent")
    msg = load_error(f"resume={missing}")
    assert msg.startswith(f"resume: no checkpoint or run folder at {missing!r}")
    assert load_config(None, [f"resume={tmp_path}"]).resume == str(tmp_path)
    for word in ("auto", "never"):
        assert load_config(None, [f"resume={word}"]).resume == word


def test_run_dir_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    assert "exists and is not a folder" in load_error(f"run.dir={f}")
    assert f"is under {str(f)!r}, a file" in load_error(f"run.dir={f}/sub/run")
    assert load_config(None, [f"run.dir={tmp_path}/new/run"]).run_dir == f"{tmp_path}/new/run"


# --- redaction -----------------------------------------------------------------------------------

SECRET = "sk-SECRET123"


@pytest.mark.parametrize("args, expected", [
    (["--api-key", SECRET, "--port", "3"], ["--api-key", "***", "--port", "3"]),
    ([f"--api-key={SECRET}"], ["--api-key=***"]),
    ([f"--api-key {SECRET}"], ["--api-key ***"]),
    (["--admin-api-key", SECRET], ["--admin-api-key", "***"]),
    (["--hf-token", SECRET], ["--hf-token", "***"]),
    (["--secret", SECRET, "--password", SECRET], ["--secret", "***", "--password", "***"]),
    (["--db-passwd", SECRET], ["--db-passwd", "***"]),
    ([f"-key={SECRET}"], ["-key=***"]),
    # Not secrets: plural "tokens", a word that merely starts with "token", a flag without a value.
    (["--max-total-tokens", "4096", "--tokenizer-path", "/m", "--enable-auth", "--port", "3"],
     ["--max-total-tokens", "4096", "--tokenizer-path", "/m", "--enable-auth", "--port", "3"]),
])
def test_redact_extra_args(args, expected):
    assert redact({"extra_args": args}) == {"extra_args": expected}


@pytest.mark.parametrize("url, expected", [
    (f"http://h:1/v1?api_key={SECRET}", "http://h:1/v1?api_key=***"),
    (f"http://h/v1?model=m&token={SECRET}&x=1", "http://h/v1?model=m&token=***&x=1"),
    (f"https://h/v1?access_token={SECRET}#frag", "https://h/v1?access_token=***#frag"),
    (f"https://h/v1?apikey={SECRET}", "https://h/v1?apikey=***"),
    (f"https://h/v1?X-Api-Key={SECRET}", "https://h/v1?X-Api-Key=***"),
    (f"https://h/?sig={SECRET}", "https://h/?sig=***"),
    ("https://h/v1?max_tokens=5&monkey=1", "https://h/v1?max_tokens=5&monkey=1"),
    (f"https://user:{SECRET}@h:1/v1", "https://user:***@h:1/v1"),
    (f"https://user:p@{SECRET}@h/v1", "https://user:***@h/v1"),            # an @ inside the password
    (f"redis://:{SECRET}@h:6379/0", "redis://:***@h:6379/0"),
    (f"http://u:{SECRET}@h/v1?key={SECRET}", "http://u:***@h/v1?key=***"),
])
def test_redact_urls(url, expected):
    assert redact({"base_url": url})["base_url"] == expected


def test_redact_keys_named_like_secrets():
    red = redact({"api_key": SECRET, "hf_token": SECRET, "db_password": SECRET, "api_key_env": "OPENAI_API_KEY",
                  "max_tokens": 5, "tokenizer": "x"})
    assert red == {"api_key": "***", "hf_token": "***", "db_password": "***", "api_key_env": "OPENAI_API_KEY",
                   "max_tokens": 5, "tokenizer": "x"}


def test_resolved_config_holds_no_secret(tmp_path):
    cfg = load_config(None, [f"run.dir={tmp_path}",
                             f"serving.policy.extra_args=[--api-key, {SECRET}, '--hf-token={SECRET}', --tp, '2']",
                             f"llm.actor.base_url=http://h:1/v1?api_key={SECRET}",
                             f"llm.policy.base_url=http://u:{SECRET}@h:2"])
    path = save_resolved(cfg)
    text = open(path).read()
    assert SECRET not in text
    saved = yaml.safe_load(text)
    assert saved["serving"]["policy"]["extra_args"] == ["--api-key", "***", "--hf-token=***", "--tp", "2"]
    assert saved["llm"]["actor"]["base_url"] == "http://h:1/v1?api_key=***"
    assert saved["llm"]["policy"]["base_url"] == "http://u:***@h:2"
    assert isinstance(load_config(path), Config)   # still a loadable recipe
    # the live config is untouched: only the written copy is redacted
    assert cfg.serving.policy.extra_args[1] == SECRET


# --- train.py stops at start-up with the one line, not after training nothing ---------------------

@pytest.mark.parametrize("override", ["rollout.group_size=1", "rollout.episode_timeout_s=-1", "trainer.save_every=0",
                                      "trainer.lr=.nan", "resume=/nonexistent"])
def test_train_py_exits_nonzero_with_one_line(tmp_path, override):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "train.py"), os.path.join(root, "configs", "test.yaml"),
                           f"run.dir={tmp_path / 'run'}", override], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode != 0
    assert proc.stderr.strip().startswith(f"config error: {override.split('=')[0]}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run").exists()     # nothing was started or written


def test_duplicate_key_inside_an_override():
    msg = load_error("trainer={lr: 1.0e-5, lr: 2.0e-5}")
    assert "override trainer=" in msg and "duplicate key 'lr'" in msg
