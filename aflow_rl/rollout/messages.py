"""The rollout pool's messages, defined once: what the pool and a worker's serve loop say to each other.

Every message is a small NamedTuple (it pickles as a class reference and its
fields, and ``match`` takes it apart by position). The pool sends, to one
worker's serve loop (``aflow_rl.rollout.runner.serve``):

- ``Run(tasks)``: episodes to run or queue there, in order;
- ``Cancel(episode_ids)``: drop these, running or queued (the caller stopped a run early);
- ``Unqueue(episode_ids)``: give back those still queued (work stealing for an idle worker);
- ``Stop()``: cancel everything and return.

The worker answers:

- ``Hello(info)``: up (``info``: pid, host, and ``error``, the start-up error or None);
- ``Started(episode_ids)``: these left the queue and run now (always said before their code runs);
- ``Unqueued(removed, asked)``: of the ``asked`` episodes, ``removed`` were still queued and are given back;
- ``Done(episode_id, result, started)``: a ``Trajectory`` or an ``EpisodeError``, and the queued
  episodes that took its place.

The transport adds, on the worker's behalf:

- ``Lost(reason)``: the worker is gone (its process exited, its thread ended, its connection broke);
  nothing more will come from this generation;
- ``Exited(reason)``: a dask task ended; its connection's end of file should follow (``Lost``).

``Dial(slot, gen)`` is the first message on a dask worker's connection back to
the pool's switchboard: which slot and generation is calling.

Between processes a message travels as a plain tuple, ``(kind number, *fields)``
(``encode``/``decode``): pickling a NamedTuple looks its class up by name on
both sides, which costs several microseconds per message, more than the rest of
a small message (bench.rollout_pool counts the workers' CPU per episode).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class WorkerStartError(RuntimeError):
    """The worker module could not be imported or initialised (the message names it and sys.path)."""


@dataclass
class EpisodeError:
    """What a worker reports instead of a Trajectory.

    kind: ``failed`` (raised, or returned the wrong type) | ``timeout``.
    stuck: a thread is still running this episode's sync code after its
    timeout; the process should be recycled once its other episodes finish.
    """

    kind: str
    error: str
    stuck: bool = False


# -- pool -> worker ----------------------------------------------------------------------------------

class Run(NamedTuple):
    tasks: list[dict]


class Cancel(NamedTuple):
    episode_ids: list[str]


class Unqueue(NamedTuple):
    episode_ids: list[str]


class Stop(NamedTuple):
    pass


# -- worker -> pool ----------------------------------------------------------------------------------

class Hello(NamedTuple):
    info: dict[str, Any]


class Started(NamedTuple):
    episode_ids: list[str]


class Unqueued(NamedTuple):
    removed: list[str]
    asked: list[str]


class Done(NamedTuple):
    episode_id: str
    result: Any  # Trajectory | EpisodeError
    started: list[str]


# -- transport -> pool -------------------------------------------------------------------------------

class Lost(NamedTuple):
    reason: str


class Exited(NamedTuple):
    reason: str


class Dial(NamedTuple):
    slot: int
    gen: int


KINDS = (Run, Cancel, Unqueue, Stop, Hello, Started, Unqueued, Done, Lost, Exited, Dial)
_KIND_NUMBER = {kind: i for i, kind in enumerate(KINDS)}


def encode(msg: tuple) -> tuple:
    """A message as a plain tuple for the wire."""
    return (_KIND_NUMBER[type(msg)], *msg)


def decode(wire: tuple) -> Any:
    """The message that ``encode`` wrote."""
    return KINDS[wire[0]]._make(wire[1:])
