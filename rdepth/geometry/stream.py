"""Streaming loop-geometry statistics from ``model.forward(observer=...)``.

Analysing 64 sequences x 512 tokens x 30 loops x 3 groups of a d=768 model
would need ~9 GB to keep every iterate. :class:`GeometryObserver` keeps, per
batch, only the previous state and previous update of the group being run
(plus the last state of the group before it, for the cross-block drift), and
folds every per-step statistic into running moments (Chan et al.'s pairwise
merge of count / mean / M2, in float64). Per-token results (convergence step,
DLR) are tiny ([N] floats) and kept whole. Full iterates are kept for one
sequence only, for the PCA figure.

The model calls ``observer(group, step, state [B, T, d], active [B, T] | None)``
for step 0 (the initial state) and after every loop step, group after group.
A call with ``group == 0, step == 0`` starts a new batch. Rows whose ``active``
flag is False did not move at that step and are left out of that step's
statistics.

The answers equal the batch functions of :mod:`rdepth.geometry.metrics` on the
concatenated iterates (tested), except the effective rank, whose Gram matrix
is accumulated from float32 products.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rdepth.errors import RdepthError
from rdepth.geometry.metrics import (
    DLR_DEFINITIONS,
    DLR_DENOMINATORS,
    EPS,
    HANDOFF,
    cosine,
    dlr_next_index,
    effective_rank_from_gram,
)

# Per-step statistics; "cosine" and "acceleration" compare step j with j+1; "state_norm" at index k is ||x^(k)||,
# the state step k starts from (the noise floor's rounding term, rdepth.geometry.summary.rounding_floors).
STEP_METRICS = ("step_size", "relative_step_size", "cosine", "acceleration", "state_norm")


@dataclass
class Moments:
    """Running count / mean / M2 per step index, merged batch by batch (float64)."""

    count: list[int] = field(default_factory=list)
    mean: list[float] = field(default_factory=list)
    m2: list[float] = field(default_factory=list)

    def add(self, index: int, values: torch.Tensor) -> None:
        """Fold ``values`` [n] into the moments of step ``index``."""
        while len(self.count) <= index:
            self.count.append(0)
            self.mean.append(0.0)
            self.m2.append(0.0)
        n = values.numel()
        if n == 0:
            return
        values = values.double()
        batch_mean = float(values.mean())
        batch_m2 = float(((values - batch_mean) ** 2).sum())
        total = self.count[index] + n
        delta = batch_mean - self.mean[index]
        self.mean[index] += delta * n / total
        self.m2[index] += batch_m2 + delta * delta * self.count[index] * n / total
        self.count[index] = total

    def summary(self) -> dict[str, np.ndarray]:
        """{"mean": [K], "std": [K] (population), "count": [K]}."""
        count = np.asarray(self.count, dtype=np.int64)
        mean = np.asarray(self.mean, dtype=np.float64)
        variance = np.asarray(self.m2, dtype=np.float64) / np.maximum(count, 1)
        return {"mean": mean, "std": np.sqrt(np.maximum(variance, 0.0)), "count": count}


@dataclass
class _GroupAccumulator:
    moments: dict[str, Moments] = field(default_factory=lambda: {m: Moments() for m in STEP_METRICS})
    grams: list[torch.Tensor] = field(default_factory=list)  # [d, d] float64 per step
    convergence: list[torch.Tensor] = field(default_factory=list)  # per batch [B*T] long
    final_relative: list[torch.Tensor] = field(default_factory=list)  # per batch [B*T]
    steps: int = 0


@dataclass
class _BatchGroup:
    """What one group needs while its loop runs on one batch (all [N = B*T] rows)."""

    group: int
    prev_state: torch.Tensor  # [N, d] float64
    prev_delta: torch.Tensor | None = None  # [N, d] float64
    computed: torch.Tensor | None = None  # [N] long, steps each row ran
    path_length: torch.Tensor | None = None  # [N] float64, sum of step sizes
    first_size: torch.Tensor | None = None  # [N] float64, size of each row's first step ||Delta^(0)||
    convergence: torch.Tensor | None = None  # [N] long, -1 = not yet
    final_relative: torch.Tensor | None = None  # [N] float64
    first_state: torch.Tensor | None = None  # [N, d] float64, each row's first computed iterate x^(1)
    extent: torch.Tensor | None = None  # [N] float64, max_k ||x^(k) - x^(1)|| so far
    drift: list[torch.Tensor] = field(default_factory=list)  # ||x^(k) - x_prev^(K)|| per step k
    last_size: torch.Tensor | None = None  # [N] float64, each row's last step ||Delta^(K-1)||, set at its close
    before_size: torch.Tensor | None = None  # [N] float64, each row's step before its last, ||Delta^(K-2)||
    last_turn: torch.Tensor | None = None  # [N] float64, cos(Delta^(K-2), Delta^(K-1)) of each row (NaN: none yet)
    steps: int = 0


@dataclass
class StreamResult:
    """Everything the observer measured, as numpy arrays.

    ``groups[g]`` maps ``<metric>_mean`` / ``_std`` / ``_count`` (per step), ``effective_rank`` [K],
    ``convergence_step`` and ``final_relative_step_size`` [N] to arrays.
    ``boundaries["g->g+1"][definition]`` is the per-token DLR [N] for every definition of
    :data:`rdepth.geometry.metrics.DLR_DEFINITIONS` (NaN where a "_refine" denominator is undefined),
    and under ``"handoff"`` the per-token :func:`rdepth.geometry.metrics.handoff_ratio`.
    ``handoff_parts["g->g+1"]`` holds what the hand-off ratio's per-token zero-drift control needs
    (:func:`rdepth.geometry.summary.handoff_control`), each [N]: ``extent`` (group g's extent after x^(1),
    the ratio's denominator), ``last_prev`` and ``last_next`` (each group's last step ||Delta^(K-1)||),
    ``before_prev`` / ``before_next`` (the step before it, ||Delta^(K-2)||) and ``turn_prev`` / ``turn_next``
    (the cosine between those two steps): each token's own contraction and turning at the end of its loop.
    ``kept_states[g]`` is [K+1, T, d] for the kept sequence (absent if none kept). ``eps``: the machine epsilon
    of the coarsest floating dtype the states came in (float64's 2.2e-16, float32's 1.2e-7): the rounding the
    steps carry, which the noise floor must stay above.
    """

    groups: list[dict[str, np.ndarray]]
    boundaries: dict[str, dict[str, np.ndarray]]
    kept_states: list[np.ndarray]
    tokens: int
    handoff_parts: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    eps: float = 0.0


class GeometryObserver:
    """Pass to ``model.forward(observer=...)`` for every batch, then call :meth:`result`.

    ``threshold``: a token has converged at the first step whose relative step
    size ||Delta^(k)|| / ||x^(k)|| is under it. ``keep_sequence``: global index
    (over all batches) of the one sequence whose full iterates are kept, or
    None. ``rank``: accumulate the d x d Gram matrix of the updates per step for
    the effective rank (costs one [N, d] x [N, d] product per step).
    """

    def __init__(self, threshold: float = 0.01, keep_sequence: int | None = 0, rank: bool = True):
        if not threshold > 0:
            raise RdepthError(f"convergence threshold must be > 0, got {threshold!r}")
        self.threshold = float(threshold)
        self.keep_sequence = keep_sequence
        self.rank = rank
        self._groups: dict[int, _GroupAccumulator] = {}
        self._boundaries: dict[tuple[int, int], dict[str, list[torch.Tensor]]] = {}
        self._handoff_parts: dict[tuple[int, int], dict[str, list[torch.Tensor]]] = {}
        self._kept: dict[int, list[torch.Tensor]] = {}
        self._current: _BatchGroup | None = None
        self._previous: _BatchGroup | None = None  # last finished group of this batch
        self._previous_last: torch.Tensor | None = None  # its final state [N, d]
        self._batch_start = 0
        self._batch_size = 0
        self._tokens = 0
        self._eps = 0.0  # machine epsilon of the coarsest floating dtype seen

    # ------------------------------------------------------------- callback
    def __call__(self, group: int, step: int, state: torch.Tensor, active: torch.Tensor | None) -> None:
        batch, seq, _ = state.shape
        if group == 0 and step == 0:
            self._close_batch()
            self._batch_size, self._tokens = batch, self._tokens + batch * seq
        if state.is_floating_point():
            self._eps = max(self._eps, float(torch.finfo(state.dtype).eps))
        flat = state.detach().reshape(batch * seq, -1).double()
        if step == 0:
            self._start_group(group, flat)
        else:
            current = self._current
            if current is None or current.group != group or step != current.steps + 1:
                raise RdepthError(f"observer got group {group} step {step} out of order")
            rows = None if active is None else active.reshape(-1).nonzero().squeeze(1)
            self._loop_step(current, flat, rows)
        self._keep(group, step, state)

    def _keep(self, group: int, step: int, state: torch.Tensor) -> None:
        index = None if self.keep_sequence is None else self.keep_sequence - self._batch_start
        if index is None or not 0 <= index < state.shape[0]:
            return
        self._kept.setdefault(group, []).append(state[index].detach().float().cpu().clone())

    def _start_group(self, group: int, flat: torch.Tensor) -> None:
        if self._current is not None:
            self._close_group()
        n, device = flat.shape[0], flat.device
        self._current = _BatchGroup(
            group=group,
            prev_state=flat,
            computed=torch.zeros(n, dtype=torch.long, device=device),
            path_length=torch.zeros(n, dtype=torch.float64, device=device),
            first_size=torch.zeros(n, dtype=torch.float64, device=device),
            convergence=torch.full((n,), -1, dtype=torch.long, device=device),
            final_relative=torch.zeros(n, dtype=torch.float64, device=device),
            first_state=flat.clone(),
            extent=torch.zeros(n, dtype=torch.float64, device=device),
            before_size=torch.zeros(n, dtype=torch.float64, device=device),
            last_turn=torch.full((n,), float("nan"), dtype=torch.float64, device=device),
        )
        self._record_drift(self._current, flat)
        self._groups.setdefault(group, _GroupAccumulator())

    def _record_drift(self, current: _BatchGroup, flat: torch.Tensor) -> None:
        if self._previous_last is not None:
            current.drift.append((flat - self._previous_last).norm(dim=-1))

    def _loop_step(self, current: _BatchGroup, flat: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Fold step k = current.steps + 1 (update Delta^(k-1)) into the statistics."""
        acc = self._groups[current.group]
        index = current.steps  # update index k-1
        prev = current.prev_state if rows is None else current.prev_state[rows]
        new = flat if rows is None else flat[rows]
        delta = new - prev
        size = delta.norm(dim=-1)
        norm = prev.norm(dim=-1)
        relative = size / (norm + EPS)
        acc.moments["step_size"].add(index, size)
        acc.moments["relative_step_size"].add(index, relative)
        acc.moments["state_norm"].add(index, norm)
        if self.rank:
            delta32 = delta.float()
            gram = (delta32.T @ delta32).double()
            if len(acc.grams) <= index:
                acc.grams.append(gram)
            else:
                acc.grams[index] += gram
        select = slice(None) if rows is None else rows
        if current.prev_delta is not None:
            before = current.prev_delta if rows is None else current.prev_delta[rows]
            before_size = before.norm(dim=-1)
            turn = cosine((delta * before).sum(dim=-1), size, before_size)
            acc.moments["cosine"].add(index - 1, turn)
            acc.moments["acceleration"].add(index - 1, (delta - before).norm(dim=-1))
            current.before_size[select] = before_size
            current.last_turn[select] = turn
        # per-token bookkeeping, then move on
        first = current.computed[select] == 0
        current.first_size[select] = torch.where(first, size, current.first_size[select])
        first_state = torch.where(first.unsqueeze(-1), new, current.first_state[select])
        current.first_state[select] = first_state
        current.extent[select] = torch.maximum(current.extent[select], (new - first_state).norm(dim=-1))
        current.computed[select] += 1
        current.path_length[select] += size
        current.final_relative[select] = relative
        fresh = (current.convergence[select] < 0) & (relative < self.threshold)
        target = torch.arange(flat.shape[0], device=flat.device)[select][fresh]
        current.convergence[target] = index
        if rows is None:
            full_delta = delta
        else:
            full_delta = torch.zeros_like(flat) if current.prev_delta is None else current.prev_delta.clone()
            full_delta[rows] = delta
        current.prev_delta = full_delta
        current.prev_state = flat
        current.steps += 1
        self._record_drift(current, flat)

    def _close_group(self) -> None:
        current = self._current
        if current is None:
            return
        acc = self._groups[current.group]
        acc.steps = max(acc.steps, current.steps)
        never = current.convergence < 0
        current.convergence[never] = current.computed[never]
        acc.convergence.append(current.convergence.cpu())
        acc.final_relative.append(current.final_relative.cpu())
        current.last_size = (current.prev_delta.norm(dim=-1) if current.prev_delta is not None
                             else torch.zeros_like(current.final_relative))
        previous = self._previous
        if previous is not None and current.drift:
            loops = {name: self._mean_step(previous, start) for name, start in DLR_DENOMINATORS.items()}
            per_definition = self._boundaries.setdefault((previous.group, current.group), {})
            for definition, (_, denominator) in DLR_DEFINITIONS.items():
                position = dlr_next_index(definition, current.steps)
                ratio = current.drift[position] / (loops[denominator] + EPS)
                per_definition.setdefault(definition, []).append(ratio.cpu())
            # metrics.handoff_ratio: hand-off states' distance over group g's extent after x^(1)
            handoff = (current.prev_state - self._previous_last).norm(dim=-1)
            extent = previous.extent
            ratio = torch.where(extent > 0, handoff / torch.where(extent > 0, extent, torch.ones_like(extent)),
                                torch.full_like(extent, float("nan")))
            per_definition.setdefault(HANDOFF, []).append(ratio.cpu())
            parts = self._handoff_parts.setdefault((previous.group, current.group), {})
            named = (("extent", extent), ("last_prev", previous.last_size), ("last_next", current.last_size),
                     ("before_prev", previous.before_size), ("before_next", current.before_size),
                     ("turn_prev", previous.last_turn), ("turn_next", current.last_turn))
            for name, value in named:
                parts.setdefault(name, []).append(value.cpu())
        self._previous, self._previous_last = current, current.prev_state
        current.prev_delta = None
        current.drift = []
        self._current = None

    @staticmethod
    def _mean_step(group: _BatchGroup, start: int) -> torch.Tensor:
        """Per row, the mean step size over the row's steps start, start+1, ... (start 0 or 1): [N].

        Start 0 is Eq. 2's denominator (all steps); start 1 leaves out the first step, the jump
        from the initial state. NaN for rows that ran no more than ``start`` steps.
        """
        if start == 0:
            return group.path_length / group.computed.clamp_min(1)
        if start != 1:
            raise RdepthError(f"the observer keeps the first step only, cannot start a mean at step {start}")
        refine = (group.path_length - group.first_size) / (group.computed - 1).clamp_min(1)
        return torch.where(group.computed > 1, refine, torch.full_like(refine, float("nan")))

    def _close_batch(self) -> None:
        self._close_group()
        self._previous = self._previous_last = None
        self._batch_start += self._batch_size
        self._batch_size = 0

    # --------------------------------------------------------------- result
    def result(self) -> StreamResult:
        """Finish the last batch and return the statistics (the observer can keep going after)."""
        self._close_group()
        self._previous = self._previous_last = None
        if not self._groups:
            raise RdepthError("the observer saw no loop steps (does the model have recurrence groups?)")
        groups: list[dict[str, np.ndarray]] = []
        for group in sorted(self._groups):
            acc = self._groups[group]
            arrays: dict[str, np.ndarray] = {}
            for metric, moments in acc.moments.items():
                for key, value in moments.summary().items():
                    arrays[f"{metric}_{key}"] = value
            if self.rank:
                arrays["effective_rank"] = np.asarray(
                    [effective_rank_from_gram(gram.cpu()) for gram in acc.grams], dtype=np.float64
                )
            arrays["convergence_step"] = torch.cat(acc.convergence).numpy()
            arrays["final_relative_step_size"] = torch.cat(acc.final_relative).numpy()
            arrays["steps"] = np.asarray(acc.steps)
            groups.append(arrays)
        boundaries = {
            f"{a}->{b}": {name: torch.cat(parts).numpy() for name, parts in definitions.items()}
            for (a, b), definitions in sorted(self._boundaries.items())
        }
        parts = {f"{a}->{b}": {name: torch.cat(values).numpy() for name, values in named.items()}
                 for (a, b), named in sorted(self._handoff_parts.items())}
        kept = [torch.stack(self._kept[g]).numpy() for g in sorted(self._kept)]
        return StreamResult(groups=groups, boundaries=boundaries, kept_states=kept, tokens=self._tokens,
                            handoff_parts=parts, eps=self._eps)
