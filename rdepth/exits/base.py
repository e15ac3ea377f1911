"""The exit-policy protocol and the registry of policies by name.

An exit policy decides, per token and per loop step, whether a token leaves a
recurrence group's loop and which state it hands on. One policy object serves
one group for a batch of ``N`` tokens (flattened ``B*T`` rows) and keeps its
per-token memory (previous update, hit flag, previous log-probabilities, ...)
in tensors indexed by the flat row index. It is a small vectorised state
machine:

* ``begin(state)`` with the initial state ``s0`` of shape ``[N, d]`` resets it;
* ``after_step(step, rows, prev, new)`` is called after loop step ``step``
  (1-based) for the ``A`` tokens still looping: ``rows`` ``[A]`` are their flat
  row indices, ``prev`` ``[A, d]`` is ``x^(step-1)`` and ``new`` ``[A, d]`` is
  ``x^(step)``. It returns ``(done [A] bool, handoff [A, d], used [A] long)``:
  which tokens stop, the state each hands on, and that state's index into the
  iterates ``0..k_max``.

A token is called only while it is looping, so a step's rows are always a
subset of the previous step's rows. The same object drives online exits
inside the model (through :class:`rdepth.exits.controller.PolicyController`)
and :func:`rdepth.exits.recorded.replay` on recorded iterates, so both give the
same exits.

Step semantics. Following the paper, ``Delta^(k) = x^(k+1) - x^(k)``; after
step ``s`` the newest update is ``Delta^(s-1) = new - prev``. Every token
stops at ``k_max`` at the latest and then hands on ``x^(k_max)``. Rules that
compare with the previous state hand on the newest one (``used = step``);
the two-hit acceleration rules follow Algorithm 1 and hand on ``x0``, the
state *before* the step on which the second hit fires (``used = step - 1``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from rdepth.errors import RdepthError

# decode(state [A, d]) -> logits [A, V]: the model's final norm and head.
Decode = Callable[[torch.Tensor], torch.Tensor]


class ExitPolicy:
    """Base class: validation, the ``k_max`` cap and the hand-off bookkeeping.

    Subclasses set the class attributes and implement :meth:`_reset` (allocate
    per-token memory for ``N`` rows) and :meth:`_exits` (the rule: a bool
    tensor ``[A]`` of tokens that stop after this step).

    Args:
        tau: threshold of the rule (a positive finite number); policies with
            ``uses_tau = False`` take none.
        k_max: most loop steps a token may compute (>= 1).
        decode: ``decode(state [A, d]) -> logits [A, V]``, only for rules that
            read the predictive distribution (``needs_decode``); latent rules
            never call it.
        options: rule-specific keyword options (listed in ``option_defaults``).
    """

    name: ClassVar[str] = ""
    uses_tau: ClassVar[bool] = True
    needs_decode: ClassVar[bool] = False
    # True for Algorithm 1's two-hit rules: an exit hands on x^(step-1).
    hands_on_previous: ClassVar[bool] = False
    option_defaults: ClassVar[dict[str, Any]] = {}
    # What ``rdepth sweep`` varies: "tau", or an option name for rules without a
    # threshold; ``default_grid`` None means the sweep's tau grid.
    sweep_parameter: ClassVar[str] = "tau"
    default_grid: ClassVar[tuple[float, ...] | None] = None
    # The largest tau the rule's signal can use (a probability's complement: 1.0); None: any positive tau.
    tau_max: ClassVar[float | None] = None
    # True for a rule that reads a head trained for one model (the learned gate): a sweep runs it only
    # when asked by name, never by default.
    trained: ClassVar[bool] = False
    # True for a rule whose ``_exits`` never reads ``step``: one call then serves rows at different loop
    # steps (:meth:`after_steps`, continuous depth batching); the others are called once per distinct step.
    step_free: ClassVar[bool] = False
    # The group whose loop this object serves (PolicyController sets it); a learned gate reads its head.
    group: int = 0
    # Whether each row may have its own threshold (:meth:`set_row_tau`: continuous depth batching, a request's
    # own tau); False for a rule whose threshold is a constant derived from tau once (learned, ouro).
    per_row_tau: ClassVar[bool] = True
    # Each row's threshold ``[N]`` (float64) once :meth:`set_row_tau` gave one; None: ``tau`` for every row.
    row_tau: torch.Tensor | None = None

    def __init__(
        self,
        tau: float | None = None,
        k_max: int = 32,
        decode: Decode | None = None,
        **options: Any,
    ) -> None:
        if self.uses_tau:
            tau = self.checked_tau(tau)
        elif tau is not None:
            raise RdepthError(f"exit policy {self.name}: takes no tau (got tau={tau!r})")
        if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
            raise RdepthError(f"exit policy {self.name}: k_max must be a positive integer, got {k_max!r}")
        unknown = sorted(set(options) - set(self.option_defaults))
        if unknown:
            allowed = ", ".join(self.option_defaults) or "none"
            raise RdepthError(
                f"exit policy {self.name}: unknown option(s) {', '.join(unknown)} (allowed: {allowed})"
            )
        self.tau = tau
        self.k_max = k_max
        self.decode = decode
        self.options = {**self.option_defaults, **options}
        self._validate_options()
        self.n_rows = 0
        self._step_tensors: dict[tuple, torch.Tensor] = {}

    @classmethod
    def checked_tau(cls, tau: Any) -> float:
        """``tau`` as the rule's threshold (a positive finite number, at most ``tau_max``), or a one-line error."""
        if tau is None:
            raise RdepthError(f"exit policy {cls.name}: needs a threshold tau")
        try:
            tau = float(tau)
        except (TypeError, ValueError):
            raise RdepthError(f"exit policy {cls.name}: tau must be a number, got {tau!r}") from None
        if not (math.isfinite(tau) and tau > 0):
            raise RdepthError(f"exit policy {cls.name}: tau must be positive and finite, got {tau!r}")
        if cls.tau_max is not None and tau > cls.tau_max:
            raise RdepthError(f"exit policy {cls.name}: tau must be in (0, {cls.tau_max:g}], got {tau!r}")
        return tau

    def _validate_options(self) -> None:
        """Check ``self.options``; raise :class:`RdepthError` naming a bad one."""

    def set_row_tau(self, rows: torch.Tensor, tau: float) -> None:
        """The rows ``rows`` (of the last :meth:`begin`) compare their signal with ``tau`` from now on, the
        others with their own (``tau`` until given another): one object serves rows of different requests, each
        at its own threshold, every decision as a policy built with that ``tau`` would make it."""
        if not (self.uses_tau and self.per_row_tau):
            raise RdepthError(f"exit policy {self.name}: takes no threshold per row")
        tau = self.checked_tau(tau)
        if self.n_rows == 0:
            raise RdepthError(f"exit policy {self.name}: set_row_tau() before begin()")
        if self.row_tau is None or self.row_tau.shape[0] != self.n_rows:
            self.row_tau = torch.full((self.n_rows,), float(self.tau), dtype=torch.float64, device=rows.device)
        self.row_tau[rows] = tau

    def _below(self, signal: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``signal < tau`` for the rows ``rows``: the rule's threshold, or each row's own (:meth:`set_row_tau`),
        compared in the signal's dtype as a Python float would be."""
        if self.row_tau is None:
            return signal < self.tau
        return signal < self.row_tau[rows].to(signal.dtype)

    def describe(self) -> dict[str, Any]:
        """Name and settings, for logs and saved results."""
        return {"policy": self.name, "tau": self.tau, "k_max": self.k_max, **self.options}

    def __repr__(self) -> str:
        settings = ", ".join(f"{key}={value!r}" for key, value in self.describe().items() if key != "policy")
        return f"{type(self).__name__}({settings})"

    # -- protocol -----------------------------------------------------------------

    def begin(self, state: torch.Tensor) -> None:
        """Start a loop for ``N`` tokens; ``state`` ``[N, d]`` is ``s0``."""
        if state.dim() != 2:
            raise RdepthError(f"exit policy {self.name}: begin() expects a state [N, d], got {tuple(state.shape)}")
        if self.needs_decode and self.decode is None:
            raise RdepthError(f"exit policy {self.name}: needs a decode function (final norm + head)")
        self.n_rows = state.shape[0]
        self._reset(state)

    def after_step(
        self, step: int, rows: torch.Tensor, prev: torch.Tensor, new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decide after loop step ``step`` (1-based) for the looping tokens ``rows``.

        Args:
            rows: ``[A]`` long, flat row indices in ``0..N-1``.
            prev: ``[A, d]``, ``x^(step-1)``; new: ``[A, d]``, ``x^(step)``.

        Returns:
            ``done`` ``[A]`` bool, ``handoff`` ``[A, d]`` (the state passed on,
            meaningful where ``done``), ``used`` ``[A]`` long (its index into
            the iterates).
        """
        if not 1 <= step <= self.k_max:
            raise RdepthError(f"exit policy {self.name}: step {step} outside 1..k_max={self.k_max}")
        exits = self._exits(step, rows, prev, new)
        done = torch.ones_like(exits) if step == self.k_max else exits
        if self.hands_on_previous:
            handoff = torch.where(exits[:, None], prev, new)
            return done, handoff, self._steps(step, rows) - exits.long()
        return done, new, self._steps(step, rows)

    def begin_rows(self, rows: torch.Tensor, state: torch.Tensor) -> None:
        """Start the loop of the rows ``rows`` ``[A]`` only (their initial states ``state`` ``[A, d]``), the
        others going on where they are: each row's memory is set as :meth:`begin` sets it. Rows index the
        ``N`` rows of the last :meth:`begin` (continuous depth batching: one row per batch slot)."""
        if self.n_rows == 0:
            raise RdepthError(f"exit policy {self.name}: begin_rows() before begin()")
        self._reset_rows(rows, state)

    @property
    def row_memory(self) -> bool:
        """Whether the rule keeps memory per row (:meth:`begin_rows` has something to reset)."""
        return type(self)._reset_rows is not ExitPolicy._reset_rows

    @property
    def one_call(self) -> bool:
        """Whether :meth:`after_steps` decides rows at any steps in one call (no call per distinct step, no
        shapes that depend on the steps: what the engine's static tick needs)."""
        return self.step_free

    def after_steps(self, steps: torch.Tensor, values: list[int], rows: torch.Tensor, prev: torch.Tensor,
                    new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`after_step` for rows at different loop steps: ``steps`` ``[A]`` long, each row's step (the
        one it just computed), ``values`` the distinct steps among them (host ints, ascending). The same
        decisions as :meth:`after_step` called on each step's rows alone: one call for a :attr:`step_free`
        rule, else one per distinct step."""
        if len(values) == 1:
            return self.after_step(values[0], rows, prev, new)
        self._check_steps(values)
        if self.step_free:
            exits = self._exits(values[0], rows, prev, new)
            done = exits | (steps == self.k_max)
            if self.hands_on_previous:
                return done, torch.where(exits[:, None], prev, new), steps - exits.long()
            return done, new, steps
        done = torch.empty(rows.shape[0], dtype=torch.bool, device=rows.device)
        handoff = torch.empty_like(new)
        used = torch.empty_like(steps)
        for value in values:
            where = (steps == value).nonzero().squeeze(1)
            part = self.after_step(value, rows[where], prev[where], new[where])
            for out, got in zip((done, handoff, used), part, strict=True):
                out[where] = got.to(out.dtype)
        return done, handoff, used

    def _check_steps(self, values: list[int]) -> None:
        """A one-line error unless the distinct steps ``values`` (ascending) lie in 1..k_max."""
        if not 1 <= values[0] <= values[-1] <= self.k_max:
            raise RdepthError(f"exit policy {self.name}: steps {values[0]}..{values[-1]} outside 1..k_max={self.k_max}")

    def _steps(self, step: int, rows: torch.Tensor) -> torch.Tensor:
        """``[A]`` long, every entry ``step``: made once per (step, A) and reused (read only)."""
        if torch.compiler.is_compiling():  # inside a compiled region: a constant it folds
            return torch.full_like(rows, step)
        key = (step, rows.shape[0], rows.device)
        cached = self._step_tensors.get(key)
        if cached is None:
            cached = self._step_tensors[key] = torch.full_like(rows, step)
        return cached

    # -- to implement ---------------------------------------------------------------

    def _reset(self, state: torch.Tensor) -> None:
        """Allocate per-token memory for ``state.shape[0]`` rows."""

    def _reset_rows(self, rows: torch.Tensor, state: torch.Tensor) -> None:
        """Set the memory of ``rows`` as :meth:`_reset` sets every row's (a rule without memory: nothing)."""

    def _exits(self, step: int, rows: torch.Tensor, prev: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def compute_dtype(state: torch.Tensor) -> torch.dtype:
    """float32, or float64 when the states are float64 (tests)."""
    return torch.promote_types(state.dtype, torch.float32)


# -- registry ----------------------------------------------------------------------

# Filled by ``@register_policy``; look policies up through :mod:`rdepth.exits.registry`,
# which imports the built-in rules first.
POLICIES: dict[str, type[ExitPolicy]] = {}


def register_policy(cls: type[ExitPolicy]) -> type[ExitPolicy]:
    """Class decorator adding a policy to :data:`POLICIES` under ``cls.name``."""
    if not cls.name or cls.name in POLICIES:
        raise ValueError(f"exit policy name {cls.name!r} is empty or taken")
    POLICIES[cls.name] = cls
    return cls
