"""Group-relative advantage estimators: GRPO and GiGPO (docs/architecture.md, Algorithms).

GRPO (Shao et al., 2024, arXiv 2402.03300): every episode of a task group is
scored against the other episodes of the same group,

    A_i = (R_i - mean_g R) / (std_g R + eps)        (norm_std=True)
    A_i =  R_i - mean_g R                           (norm_std=False)

GiGPO (Feng et al., 2025, "Group-in-Group Policy Optimization for LLM Agent
Training", arXiv 2505.10978) adds a step-level group inside each task group:
steps whose environment state (the *anchor state*) is identical across the
group's trajectories are compared on their discounted step return,

    A = A^E + omega * A^S
    A^E = (R - mean_g R) / F            R = sum_t r_t, one value per trajectory
    A^S = (R_t - mean_{G(s)} R_t) / F   R_t = sum_{k>=t} gamma^(k-t) r_k
    F = std + eps (mode "mean_std_norm") or 1 (mode "mean_norm").

Every std is the sample standard deviation (ddof=1, as ``torch.std``). A group
of one member carries no relative information, so its advantage is 0.

Group ids, trajectory ids and anchor keys may be any hashable values (str,
int, tuple); they are compared by equality (``1`` and ``"1"`` are different
groups), never converted to strings.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable, Sequence

import numpy as np

if TYPE_CHECKING:  # imported for annotations only: algos must not pull in config at import time
    from aflow_rl.config import AlgoConfig
    from aflow_rl.rollout.types import Trajectory

GIGPO_MODES = ("mean_norm", "mean_std_norm")


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _as_rewards(x: Any, name: str) -> np.ndarray:
    """A 1-D float64 array of finite values, or a ValueError naming ``name``."""
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one value per row), got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise ValueError(f"{name}[{bad}] = {arr[bad]} is not finite; rewards must be finite numbers")
    return arr


def _as_list(x: Any, n: int, name: str) -> list:
    """``x`` as a Python list of length ``n`` (keeps ids' own types: no str coercion)."""
    if isinstance(x, np.ndarray) and x.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {x.shape}")
    items = list(x)
    if len(items) != n:
        raise ValueError(f"{name} has {len(items)} entries but there are {n} rewards; "
                         f"{name} needs exactly one entry per reward row")
    return items


def _factorize(values: Sequence[Hashable], name: str) -> tuple[np.ndarray, int]:
    """Integer codes in first-appearance order. Returns (codes [N] int64, number of distinct values)."""
    index: dict[Hashable, int] = {}
    codes = np.empty(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        try:
            codes[i] = index.setdefault(v, len(index))
        except TypeError:
            raise ValueError(f"{name}[{i}] = {v!r} is not hashable; use str, int or tuple ids") from None
    return codes, len(index)


def _group_normalize(x: np.ndarray, codes: np.ndarray, n_groups: int, *,
                     use_std: bool, eps: float) -> np.ndarray:
    """(x - mean_g x) / (std_g x + eps) or x - mean_g x, per group; groups of one get 0.

    x: [N] float64, codes: [N] group index in [0, n_groups). Sample std (ddof=1),
    computed from the centred values (two-pass, no cancellation). A group whose
    values are all equal gets exactly 0, also with eps=0 (its floating-point
    mean may differ from the values by an ulp, which must not become +-1).
    """
    counts = np.bincount(codes, minlength=n_groups)                    # [G]
    means = np.bincount(codes, weights=x, minlength=n_groups) / np.maximum(counts, 1)
    dev = x - means[codes]                                             # [N]
    if use_std:
        ss = np.bincount(codes, weights=dev * dev, minlength=n_groups)  # [G] sum of squared deviations
        std = np.sqrt(ss / np.maximum(counts - 1, 1))                  # [G] ddof=1
        with np.errstate(divide="ignore", invalid="ignore"):  # eps=0 on degenerate groups, zeroed below
            out = dev / (std[codes] + eps)
    else:
        out = dev
    gmin = np.full(n_groups, np.inf)
    gmax = np.full(n_groups, -np.inf)
    np.minimum.at(gmin, codes, x)
    np.maximum.at(gmax, codes, x)
    degenerate = (counts < 2) | (gmin == gmax)                         # [G] no relative signal
    out[degenerate[codes]] = 0.0
    return out


# ---------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------


def grpo(rewards, group_ids, *, norm_std: bool = True, eps: float = 1e-6) -> np.ndarray:
    """GRPO advantage per episode (arXiv 2402.03300, outcome supervision).

    ``A_i = (R_i - mean_g R) / (std_g R + eps)`` with the sample std (ddof=1);
    ``norm_std=False`` gives ``R_i - mean_g R``. A group of one member gets 0.

    rewards: [N] episode rewards; group_ids: [N] hashable task-group ids.
    Returns [N] float64.
    """
    r = _as_rewards(rewards, "rewards")
    ids = _as_list(group_ids, len(r), "group_ids")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if len(r) == 0:
        return np.zeros(0, dtype=np.float64)
    codes, n_groups = _factorize(ids, "group_ids")
    return _group_normalize(r, codes, n_groups, use_std=bool(norm_std), eps=float(eps))


# ---------------------------------------------------------------------------
# GiGPO
# ---------------------------------------------------------------------------


class _NoAnchor:
    """Marks a step without an anchor state: it forms a step group of its own (A^S = 0)."""


def _discounted_returns(r: np.ndarray, ends: np.ndarray, lengths: np.ndarray, gamma: float) -> np.ndarray:
    """R_t = sum_{k>=t} gamma^(k-t) r_k within each trajectory.

    r: [N] rows, trajectories contiguous; ends: [T] one past each trajectory's
    last row; lengths: [T]. Loops over the time-from-the-end k (at most the
    longest trajectory), vectorised across trajectories; no gamma^-t factors,
    so small gamma cannot overflow.
    """
    ret = r.copy()                                   # k = 0: the last step's return is its reward
    for k in range(1, int(lengths.max())):
        rows = ends[lengths > k] - 1 - k             # [T_k] the row k steps before each trajectory's end
        ret[rows] = r[rows] + gamma * ret[rows + 1]
    return ret


def gigpo(step_rewards, traj_ids, group_ids, anchor_keys, *, gamma: float = 1.0,
          omega: float = 1.0, mode: str = "mean_norm", eps: float = 1e-6) -> np.ndarray:
    """GiGPO advantage per step (Feng et al., 2025, arXiv 2505.10978, Sec. 4).

    ``A = A^E + omega * A^S`` where

    - episode level: ``R = sum_t r_t`` per trajectory and
      ``A^E = (R - mean_g R) / F`` over the trajectories of the task group
      (each trajectory counted once, not once per step);
    - step level: anchor-state groups ``G(s)`` are the steps of one task group
      with the same anchor key (equal keys in different task groups are
      different groups); ``R_t = sum_{k>=t} gamma^(k-t) r_k`` within the
      trajectory and ``A^S = (R_t - mean_{G(s)} R_t) / F``;
    - ``F = std + eps`` (``mode="mean_std_norm"``, sample std, ddof=1) or
      ``F = 1`` (``mode="mean_norm"``).

    A step group of one member has ``A^S = 0``; a task group of one trajectory
    has ``A^E = 0``. An anchor key of ``None`` means "state unknown": that step
    is its own step group.

    step_rewards: [N] one row per step, the rows of a trajectory contiguous and
    in time order; traj_ids, group_ids, anchor_keys: [N] hashable, group_ids
    constant within a trajectory. Returns [N] float64, one advantage per row.
    """
    r = _as_rewards(step_rewards, "step_rewards")
    n = len(r)
    tids = _as_list(traj_ids, n, "traj_ids")
    gids = _as_list(group_ids, n, "group_ids")
    keys = _as_list(anchor_keys, n, "anchor_keys")
    _check_gigpo_args(mode, gamma, omega, eps)
    if n == 0:
        return np.zeros(0, dtype=np.float64)
    use_std = mode == "mean_std_norm"
    tcode, starts, ends = _trajectory_runs(tids)                      # [N], [T], [T]
    gcode, n_groups = _factorize(gids, "group_ids")                  # [N]
    mixed = np.flatnonzero((tcode[1:] == tcode[:-1]) & (gcode[1:] != gcode[:-1]))
    if len(mixed):
        i = int(mixed[0]) + 1
        raise ValueError(f"group_ids: trajectory {tids[i]!r} has rows in groups {gids[i - 1]!r} and {gids[i]!r}; "
                         f"a trajectory belongs to exactly one task group")

    # Episode level: one return per trajectory, normalised within its task group.
    ep_return = np.add.reduceat(r, starts)                             # [T]
    a_episode = _group_normalize(ep_return, gcode[starts], n_groups, use_std=use_std, eps=eps)  # [T]

    # Step level: anchor groups keyed by (task group, anchor key).
    step_return = _discounted_returns(r, ends, ends - starts, float(gamma))  # [N]
    scode, n_step_groups = _factorize(_step_group_keys(gcode, keys), "anchor_keys")  # [N]
    a_step = _group_normalize(step_return, scode, n_step_groups, use_std=use_std, eps=eps)  # [N]

    return a_episode[tcode] + float(omega) * a_step


def _check_gigpo_args(mode: str, gamma: float, omega: float, eps: float) -> None:
    if mode not in GIGPO_MODES:
        raise ValueError(f"mode must be one of {GIGPO_MODES}, got {mode!r}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not np.isfinite(omega):
        raise ValueError(f"omega must be finite, got {omega}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def _trajectory_runs(tids: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [N], starts [T], ends [T]) of the contiguous row blocks of each trajectory.

    Codes follow first appearance, so contiguous rows give runs whose codes are exactly
    0, 1, 2, ... (one run per trajectory); a trajectory that reappears is a ValueError.
    """
    n = len(tids)
    tcode, n_traj = _factorize(tids, "traj_ids")                     # [N]
    new_run = np.ones(n, dtype=bool)
    new_run[1:] = tcode[1:] != tcode[:-1]
    starts = np.flatnonzero(new_run)                                   # [T_runs]
    if len(starts) != n_traj:
        seen: set[int] = set()
        for s in starts:
            if tcode[s] in seen:
                raise ValueError(f"traj_ids: the rows of trajectory {tids[s]!r} are not contiguous "
                                 f"(it reappears at row {s}); give each trajectory's steps in one block, in time order")
            seen.add(int(tcode[s]))
    return tcode, starts, np.append(starts[1:], n)


def _step_group_keys(gcode: np.ndarray, keys: list) -> list:
    """The step-group key of each row: (task group, anchor key); a None key is a group of its own."""
    for i, k in enumerate(keys):
        try:
            hash(k)
        except TypeError:
            raise ValueError(f"anchor_keys[{i}] = {k!r} is not hashable; use str, int or tuple keys") from None
    return [(int(g), k) if k is not None else (int(g), _NoAnchor, i) for i, (g, k) in enumerate(zip(gcode, keys))]


# ---------------------------------------------------------------------------
# Trainer-facing helpers
# ---------------------------------------------------------------------------


def valid_group_mask(group_ids, ok, *, min_size: int = 2) -> np.ndarray:
    """Which episodes enter the advantage computation (issue 4, item 4).

    Failed episodes (``ok`` false) leave their group; a group left with fewer
    than ``min_size`` ok members is skipped entirely. group_ids: [N] hashable,
    ok: [N] bool. Returns [N] bool.
    """
    ok_arr = np.asarray(ok, dtype=bool).reshape(-1)
    ids = _as_list(group_ids, len(ok_arr), "group_ids")
    if len(ok_arr) == 0:
        return np.zeros(0, dtype=bool)
    codes, n_groups = _factorize(ids, "group_ids")
    ok_per_group = np.bincount(codes, weights=ok_arr.astype(np.float64), minlength=n_groups)  # [G]
    return ok_arr & (ok_per_group[codes] >= min_size)


def from_trajectories(cfg: "AlgoConfig", trajectories: "Sequence[Trajectory]", rewards) -> list[np.ndarray]:
    """Per-turn advantages for a batch of episodes, with the estimator ``cfg.adv_estimator``.

    ``rewards[i]`` is episode i's terminal (e.g. PARL-shaped) reward; each
    turn's ``step_reward`` is an intermediate reward. Both estimators see the
    same episode return ``R_i = sum_t step_reward_t + rewards[i]``:

    - ``grpo``: ``grpo(R, group_id, norm_std=cfg.norm_std)``, the same value
      on every turn of the episode;
    - ``gigpo``: one row per turn, the terminal reward added to the last
      turn's row, anchor keys from ``Turn.anchor_key``, with ``cfg.gamma``,
      ``cfg.omega`` and ``cfg.gigpo_mode``.

    Filter failed episodes and undersized groups first (``valid_group_mask``).
    Returns one [n_turns_i] float64 array per trajectory.
    """
    rew = _as_rewards(rewards, "rewards")
    if len(rew) != len(trajectories):
        raise ValueError(f"{len(rew)} rewards for {len(trajectories)} trajectories")
    if not trajectories:
        return []
    for t in trajectories:
        if not t.turns:
            raise ValueError(f"trajectory {t.episode_id!r} has no turns; drop it before computing advantages")
    lengths = [len(t.turns) for t in trajectories]
    step_r = [t.step_rewards for t in trajectories]                    # each [n_turns_i]

    if cfg.adv_estimator == "grpo":
        returns = np.array([s.sum() for s in step_r], dtype=np.float64) + rew  # [B]
        adv = grpo(returns, [t.group_id for t in trajectories], norm_std=cfg.norm_std)
        return [np.full(n, a, dtype=np.float64) for n, a in zip(lengths, adv)]
    if cfg.adv_estimator == "gigpo":
        rows = []
        for s, final in zip(step_r, rew):
            s = s.copy()
            s[-1] += final
            rows.append(s)
        # Row identity uses the batch position: episode ids are unique per batch by
        # contract, but the position makes that assumption unnecessary here.
        adv = gigpo(np.concatenate(rows),
                    [i for i, n in enumerate(lengths) for _ in range(n)],
                    [t.group_id for t in trajectories for _ in t.turns],
                    [turn.anchor_key for t in trajectories for turn in t.turns],
                    gamma=cfg.gamma, omega=cfg.omega, mode=cfg.gigpo_mode)
        return np.split(adv, np.cumsum(lengths)[:-1])
    raise ValueError(f"algo.adv_estimator must be 'grpo' or 'gigpo', got {cfg.adv_estimator!r}")


def step_group_fraction(trajectories: Sequence["Trajectory"]) -> float:
    """Share of the turns that fall in GiGPO step groups of two or more: the turns of one episode
    group (``group_id``) with the same ``anchor_key`` (turns without a key are groups of their own).
    What GiGPO adds over GRPO comes only from these turns; 0.0 for no turns."""
    keys = [(t.group_id, turn.anchor_key) for t in trajectories for turn in t.turns]
    if not keys:
        return 0.0
    counts: dict = {}
    for k in keys:
        if k[1] is not None:
            counts[k] = counts.get(k, 0) + 1
    return sum(1 for k in keys if k[1] is not None and counts[k] >= 2) / len(keys)

