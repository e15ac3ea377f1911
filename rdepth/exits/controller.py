"""Exit policies as a model loop controller (:class:`rdepth.model.control.LoopController`).

``model.forward(idx, controller=PolicyController(...))`` runs each group's
loop over the tokens still active and asks the group's policy after every
step which of them stop. Groups are independent: each has its own policy
object (its own ``tau``, ``k_max`` and per-token memory).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rdepth.errors import RdepthError
from rdepth.exits.base import Decode, ExitPolicy
from rdepth.exits.registry import get_policy_class, make_policy

PolicySource = Sequence[ExitPolicy] | Callable[[int], ExitPolicy]


class PolicyController:
    """Per-group exit policies behind the model's loop-controller protocol.

    Args:
        policies: one :class:`ExitPolicy` per group (a sequence indexed by group),
            or a factory ``group -> ExitPolicy`` called once per group on first use.
        decode: ``decode(state [A, d]) -> logits [A, V]`` (the model's
            ``readout``, or a :class:`rdepth.exits.decode.RestDecode`), given to
            policies that read the predictive distribution and were built
            without one. A decode with ``begin``/``observe``/``settle`` (a
            reading through the later layers) is told, for the groups whose
            policy reads through it, which rows loop and what each stopped row
            handed on.
    """

    def __init__(self, policies: PolicySource, decode: Decode | None = None) -> None:
        if isinstance(policies, ExitPolicy):
            raise RdepthError(
                "PolicyController needs one policy per group (a list) or a factory group -> policy, "
                "not a single policy object shared by every group"
            )
        self._factory: Callable[[int], ExitPolicy] | None = None
        self._policies: dict[int, ExitPolicy] = {}
        if callable(policies):
            self._factory = policies
        else:
            policies = list(policies)
            if len({id(policy) for policy in policies}) != len(policies):
                raise RdepthError("PolicyController: the same policy object is given for two groups")
            for group, policy in enumerate(policies):
                self._policies[group] = self._checked(policy, group)
        self.decode = decode

    @staticmethod
    def _checked(policy: Any, group: int) -> ExitPolicy:
        if not isinstance(policy, ExitPolicy):
            raise RdepthError(f"PolicyController: group {group} has {type(policy).__name__}, not an ExitPolicy")
        return policy

    def policy(self, group: int) -> ExitPolicy:
        """The policy of ``group`` (built by the factory on first use)."""
        if group not in self._policies:
            if self._factory is None:
                raise RdepthError(
                    f"PolicyController has policies for {len(self._policies)} group(s); "
                    f"the model asked for group {group}"
                )
            self._policies[group] = self._checked(self._factory(group), group)
        policy = self._policies[group]
        policy.group = group  # which group's head a learned gate reads
        if policy.needs_decode and policy.decode is None:
            policy.decode = self.decode
        return policy

    # -- LoopController protocol ----------------------------------------------------

    def max_steps(self, group: int) -> int:
        return self.policy(group).k_max

    def _tracking(self, policy: ExitPolicy) -> bool:
        """Whether ``policy`` reads through this controller's decode, and that decode needs the rows."""
        return policy.decode is self.decode and hasattr(self.decode, "observe")

    def begin(self, group: int, state: torch.Tensor) -> None:
        policy = self.policy(group)
        if self._tracking(policy):
            self.decode.begin(group, state)
        policy.begin(state)

    def begin_rows(self, group: int, rows: torch.Tensor, state: torch.Tensor) -> None:
        """Start the loop of ``rows`` only (continuous depth batching); needs a head reading (``decode``
        without row tracking): a reading through the later layers is defined for whole windows only."""
        policy = self.policy(group)
        if self._tracking(policy):
            raise RdepthError("exit rules reading through the later layers (decode rest) run on whole windows, "
                              "not on rows that begin at different times; use the head reading")
        policy.begin_rows(rows, state)

    def set_row_tau(self, rows: torch.Tensor, tau: float) -> None:
        """Every group's policy compares the rows ``rows`` with ``tau`` (:meth:`ExitPolicy.set_row_tau`)."""
        for group in sorted(self._policies):
            self.policy(group).set_row_tau(rows, tau)

    def after_steps(self, group: int, steps: torch.Tensor, values: list[int], rows: torch.Tensor,
                    prev: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`after_step` for rows at different steps (``steps`` ``[A]``, ``values`` the distinct ones):
        :meth:`ExitPolicy.after_steps`."""
        return self.policy(group).after_steps(steps, values, rows, prev, new)

    def after_step(
        self, group: int, step: int, rows: torch.Tensor, prev: torch.Tensor, new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        policy = self.policy(group)
        if not self._tracking(policy):
            return policy.after_step(step, rows, prev, new)
        self.decode.observe(group, rows, new)
        done, handoff, used = policy.after_step(step, rows, prev, new)
        self.decode.settle(group, rows, done, handoff)
        return done, handoff, used


def controller_factory(
    policy: str,
    value: float | Sequence[float] | None = None,
    k_max: int | Sequence[int] = 32,
    decode_factory: Callable[[], Decode] | None = None,
    options: dict | None = None,
) -> Callable[[], PolicyController]:
    """The one way from a policy name and its threshold(s) to loop controllers: a factory of fresh
    :class:`PolicyController` objects running ``policy`` in every group, each group's policy made by
    :func:`~rdepth.exits.registry.make_policy` (``controller_factory(name, tau, k_max)()`` is one
    controller).

    Args:
        policy: a registered rule (:mod:`rdepth.exits.policies`).
        value: its swept parameter (``tau``, or e.g. ``argmax_stable``'s ``patience``), one value or
            one per group (an exit profile's calibrated values); None: the rule's default (a rule with a
            threshold then refuses).
        k_max: the most loop steps, one value or one per group.
        decode_factory: a fresh reading per controller (``lambda: model.readout``, or a
            :class:`~rdepth.exits.decode.RestDecode` maker) for rules that read the distribution.
        options: further policy options (e.g. the KL direction); the swept parameter may come here by
            name instead (``{"patience": 2}``) when ``value`` is None.

    Every group's settings are checked here, before any model runs (one-line errors).
    """
    cls = get_policy_class(policy)
    options = dict(options or {})
    if value is None and cls.sweep_parameter in options:
        value = options.pop(cls.sweep_parameter)
    caps = None if isinstance(k_max, int) else tuple(int(k) for k in k_max)
    values = None if value is None or isinstance(value, (int, float)) else tuple(value)
    if caps is not None and values is not None and len(caps) != len(values):
        raise RdepthError(f"exit policy {policy}: {len(values)} values for {len(caps)} k_max values")

    def build(group: int) -> ExitPolicy:
        for name, per_group in (("k_max", caps), ("values", values)):
            if per_group is not None and group >= len(per_group):
                raise RdepthError(f"exit policy {policy}: {name} has {len(per_group)} entries; the model asked "
                                  f"for group {group}")
        cap = k_max if caps is None else caps[group]
        chosen = value if values is None else values[group]
        if chosen is None:
            return make_policy(policy, k_max=cap, **options)
        if cls.sweep_parameter == "tau":
            return make_policy(policy, tau=chosen, k_max=cap, **options)
        chosen = int(chosen) if float(chosen).is_integer() else chosen
        return make_policy(policy, k_max=cap, **{cls.sweep_parameter: chosen}, **options)

    for group in range(max(1, len(caps or ()), len(values or ()))):
        build(group)  # bad settings fail here, before the model runs
    return lambda: PolicyController(build, decode=decode_factory() if decode_factory is not None else None)
