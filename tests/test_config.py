"""Config loading: strict keys and types, overrides, redaction, every shipped YAML loads."""
import glob
import os

import pytest
import yaml

from aflow_rl.config import Config, ConfigError, all_keys, format_help, load_config, redact, save_resolved

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"quickstart.yaml", "test.yaml", "deep.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_yaml_loads_and_starts_with_launch_command(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    with open(path) as fh:
        first = fh.readline()
    assert first.startswith("#") and ("train.py" in first or "python -m" in first), first


def test_overrides_are_typed():
    cfg = load_config(None, ["trainer.lr=1e-6", "rollout.workers=4", "run.name=x",
                             "trainer.betas=[0.8, 0.9]", "rollout.trace=false"])
    assert cfg.trainer.lr == pytest.approx(1e-6)
    assert cfg.rollout.workers == 4
    assert cfg.run.name == "x" and cfg.run_dir == os.path.join("runs", "x")
    assert cfg.trainer.betas == [0.8, 0.9]
    assert cfg.rollout.trace is False


def test_int_widens_to_float_but_not_reverse():
    assert load_config(None, ["trainer.lr=1"]).trainer.lr == 1.0
    with pytest.raises(ConfigError, match=r"rollout.workers: expected int, got 2.5"):
        load_config(None, ["rollout.workers=2.5"])


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.lrr': did you mean 'trainer.lr'\?"):
        load_config(None, ["trainer.lrr=1"])
    with pytest.raises(ConfigError, match=r"did you mean 'rollout.workers'"):
        load_config(None, ["rollout.worker_s=1"])


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("trainer:\n  max_stepz: 3\n")
    with pytest.raises(ConfigError, match="trainer.max_stepz.*trainer.max_steps"):
        load_config(str(p))


def test_wrong_type_and_choice():
    with pytest.raises(ConfigError, match=r"rollout.workers: expected int, got 'many' \(str\)"):
        load_config(None, ["rollout.workers=many"])
    with pytest.raises(ConfigError, match=r"rollout.backend: expected one of 'loky' \| 'threading'"):
        load_config(None, ["rollout.backend=ray"])
    with pytest.raises(ConfigError, match="trainer: expected a mapping"):
        load_config(None, ["trainer=3"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


def test_errors_are_one_line():
    for overrides in (["x.y=1"], ["rollout.workers=a"], ["rollout.workers=0"], ["noequals"]):
        with pytest.raises(ConfigError) as info:
            load_config(None, overrides)
        assert "\n" not in str(info.value)


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="rollout.workers: must be at least 1"):
        load_config(None, ["rollout.workers=0"])
    with pytest.raises(ConfigError, match="serving.actor.urls"):
        load_config(None, ["serving.actor.backend=external"])
    with pytest.raises(ConfigError, match="dask_address"):
        load_config(None, ["rollout.backend=dask"])


def test_every_field_has_help():
    text = format_help()
    for key in all_keys():
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(key + " "))
        assert len(line.split("  ")[-1].strip()) > 5, f"{key} has no help"


def test_redaction_and_resolved_file(tmp_path):
    data = {"api_key": "sk-123", "llm": {"api_key_env": "OPENAI_API_KEY", "hf_token": "hf_x",
                                         "base_url": "https://user:pass@host/v1", "max_tokens": 5}}
    red = redact(data)
    assert red["api_key"] == "***" and red["llm"]["hf_token"] == "***"
    assert red["llm"]["api_key_env"] == "OPENAI_API_KEY"  # names a variable, not a secret
    assert red["llm"]["base_url"] == "https://user:***@host/v1"
    assert red["llm"]["max_tokens"] == 5

    cfg = load_config(None, [f"run.dir={tmp_path}", "llm.actor.base_url=http://u:secret@h:1"])
    path = save_resolved(cfg)
    assert path == os.path.join(str(tmp_path), "config.yaml")
    saved = yaml.safe_load(open(path))
    assert saved["llm"]["actor"]["base_url"] == "http://u:***@h:1"
    # The resolved file loads back as a config (minus the redacted secret).
    assert load_config(path).rollout.workers == cfg.rollout.workers


def test_in_flight_sync_keys():
    cfg = load_config(None, [])
    assert cfg.trainer.sync_inflight is False and cfg.trainer.sync_pause_mode == "in_place"   # today's sync
    cfg = load_config(None, ["trainer.sync_inflight=true", "trainer.sync_pause_mode=retract"])
    assert cfg.trainer.sync_inflight is True and cfg.trainer.sync_pause_mode == "retract"
    # abort would throw away every episode in flight at each sync: not a sync mode.
    with pytest.raises(ConfigError, match=r"trainer.sync_pause_mode: expected one of 'in_place' \| 'retract'"):
        load_config(None, ["trainer.sync_pause_mode=abort"])


def test_in_flight_sync_is_refused_with_the_distributed_method():
    """sync=distributed does not pause the servers around its buckets: the flag must not be silently ignored."""
    with pytest.raises(ConfigError, match=r"trainer.sync_inflight=true works with trainer.sync=disk only"):
        load_config(None, ["trainer.sync=distributed", "trainer.sync_inflight=true"])
    assert load_config(None, ["trainer.sync=distributed"]).trainer.sync_inflight is False
    assert load_config(None, ["trainer.sync_inflight=true"]).trainer.sync == "disk"
