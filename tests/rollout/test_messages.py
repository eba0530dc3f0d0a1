"""rollout.messages: every message survives the wire form (encode -> pickle -> decode) as itself."""
import pickle

import pytest

from aflow_rl.rollout import messages as m
from aflow_rl.rollout.types import Trajectory

SAMPLES = [m.Run([{"episode_id": "e0", "seed": 1}]), m.Cancel(["e0"]), m.Unqueue(["e1", "e2"]), m.Stop(),
           m.Hello({"pid": 7, "error": None}), m.Started(["e0"]), m.Unqueued(["e2"], ["e1", "e2"]),
           m.Done("e0", Trajectory("e0", "g0"), ["e1"]), m.Done("e1", m.EpisodeError("timeout", "late", True), []),
           m.Lost("killed by SIGKILL"), m.Exited("worker exited"), m.Dial(3, 2)]


def test_every_kind_has_a_sample():
    assert {type(s) for s in SAMPLES} == set(m.KINDS)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip_keeps_kind_and_fields(msg):
    wire = m.encode(msg)
    assert type(wire) is tuple and type(wire[0]) is int  # plain tuple on the wire: no class lookup
    back = m.decode(pickle.loads(pickle.dumps(wire)))
    assert type(back) is type(msg) and back == msg


def test_a_non_message_is_refused():
    with pytest.raises(KeyError):
        m.encode(("done", "e0", None, []))
