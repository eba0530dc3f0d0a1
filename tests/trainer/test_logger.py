"""TensorBoard logger: what rank 0 writes reads back with EventAccumulator; other ranks write nothing."""
import os

import numpy as np
import pytest

from aflow_rl.trainer.logger import TBLogger, flatten


def read_events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_flatten():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None, "e": "x"}) == {"a.b": 1, "a.c": "[1, 2]", "d": "None", "e": "x"}


def test_scalars_text_histogram_hparams_roundtrip(tmp_path):
    run = str(tmp_path)
    with TBLogger(run, rank=0) as tb:
        tb.hparams({"trainer": {"lr": 1e-5, "zero_stage": 3}, "algo": {"loss_agg": "token_mean"}})
        for step in range(3):
            tb.scalars({"rewards/mean": 0.1 * step, "losses/policy": -step, "skip/me": None}, step)
        tb.text("samples/episode", '{"action": "spawn"}\nline two', 2)
        tb.histogram("rewards/advantages", np.array([0.5, -0.5, np.nan, 1.0]), 2)
    acc = read_events(os.path.join(run, "events"))
    tags = acc.Tags()
    assert {"rewards/mean", "losses/policy"} <= set(tags["scalars"]) and "skip/me" not in tags["scalars"]
    assert [e.step for e in acc.Scalars("rewards/mean")] == [0, 1, 2]
    assert [e.value for e in acc.Scalars("losses/policy")] == pytest.approx([0, -1, -2])
    hist = acc.Histograms("rewards/advantages")[0]
    assert hist.step == 2 and hist.histogram_value.num == 3           # the NaN is dropped
    text = acc.Tensors("samples/episode/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '    {"action": "spawn"}' in text and "    line two" in text
    assert "_hparams_/experiment" in acc.PluginTagToContent("hparams")


def test_other_ranks_write_nothing(tmp_path):
    tb = TBLogger(str(tmp_path), rank=1)
    assert not tb.enabled
    tb.scalars({"a": 1.0}, 0)
    tb.text("t", "x", 0)
    tb.histogram("h", [1.0], 0)
    tb.hparams({"a": 1})
    tb.close()
    assert not os.path.exists(tmp_path / "events")
