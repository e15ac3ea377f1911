"""Exit policies as a model loop controller (:class:`rdepth.model.control.LoopController`).

``model.forward(idx, controller=PolicyController(...))`` runs each group's
loop over the tokens still active and asks the group's policy after every
step which of them stop. Groups are independent: each has its own policy
object (its own ``tau``, ``k_max`` and per-token memory).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import torch

from rdepth.errors import RdepthError
from rdepth.exits.base import Decode, ExitPolicy
from rdepth.exits.registry import make_policy

PolicySource = Union[Sequence[ExitPolicy], Callable[[int], ExitPolicy]]


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

    @classmethod
    def from_name(
        cls,
        name: str,
        tau: float | Sequence[float] | None = None,
        k_max: int | Sequence[int] = 32,
        decode: Decode | None = None,
        **options: Any,
    ) -> "PolicyController":
        """The same rule in every group; ``k_max`` and ``tau`` are one value or one per group (an
        exit profile's calibrated thresholds)."""

        caps = None if isinstance(k_max, int) else tuple(k_max)
        taus = None if tau is None or isinstance(tau, (int, float)) else tuple(float(t) for t in tau)
        if caps is not None and taus is not None and len(caps) != len(taus):
            raise RdepthError(f"PolicyController: {len(taus)} tau values for {len(caps)} k_max values")

        def factory(group: int) -> ExitPolicy:
            if caps is not None and group >= len(caps):
                raise RdepthError(f"PolicyController: k_max has {len(caps)} values; the model asked for group {group}")
            if taus is not None and group >= len(taus):
                raise RdepthError(f"PolicyController: tau has {len(taus)} values; the model asked for group {group}")
            return make_policy(name, tau=tau if taus is None else taus[group],
                               k_max=k_max if caps is None else caps[group], **options)

        for group in range(max(1, len(caps or ()), len(taus or ()))):
            factory(group)  # bad settings fail here, before the model runs
        return cls(factory, decode=decode)

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
