"""A depth per request: the ``rdepth`` object of a request body, within the bounds the server sets.

A request may ask for its own loop depth in place of the server's budget or rule:

* ``{"loops": N}``: a fixed budget of N loop steps in every group;
* ``{"exit": RULE, "tau": X, "k_max": N}``: one of the rules the server allows (``--allow-exits``) at its own
  threshold (default: the one the server set for that rule) and cap (default: the server's own, its
  ``--k-max`` or ``--loops``).

The engine runs each row under its own request's depth in the same batch (:class:`rdepth.engine.Depth`), each
choice's tokens those of its batch-1 decode at that budget or rule. The server's bounds: ``--max-loops`` (the
engine's caps: no request's loops or k_max above the smallest group's) and the rules it allows. A request's
depth equal to the server's own policy runs as a request without one (the engine's own controller).

:func:`build_engine` makes the engine and the :class:`Depths` a request is read against; :meth:`Depths.read`
reads one ``rdepth`` object, or raises :class:`~rdepth.serve.errors.BadRequest` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from rdepth.engine import Depth, Engine
from rdepth.errors import RdepthError
from rdepth.serve.errors import BadRequest

FIELDS = ("loops", "exit", "tau", "k_max")


@dataclass(frozen=True)
class AllowedRule:
    """An exit rule a request may name: its threshold when the request gives none (None: the request must give
    one, unless the rule takes none), whether it takes a threshold at all and one per request, the most a
    threshold may be, and its options (``--exit-options`` for the server's own rule; the run's gate for the
    learned rule)."""

    name: str
    tau: float | None
    uses_tau: bool
    per_row_tau: bool
    tau_max: float | None
    options: dict = field(default_factory=dict)

    def echoed_options(self) -> dict:
        return {key: str(value) for key, value in self.options.items()}


@dataclass
class Depths:
    """What a request's ``rdepth`` object may ask for, and what a request without one runs.

    ``caps``: the engine's loop-step caps per group; ``rules``: the rules a request may name; ``default``: the
    depth of a request without its own (None: the engine's own controller); ``policy``: the server's policy,
    as the depth report echoes it; ``k_max``: a rule's cap where the request gives none (None: the engine's
    caps, which are then the server's own)."""

    caps: tuple[int, ...]
    rules: dict[str, AllowedRule]
    default: Depth | None
    policy: dict
    k_max: int | None = None

    @property
    def bound(self) -> int:
        """The most loop steps a request may ask for (``loops``, ``k_max``): the smallest group's cap."""
        return min(self.caps)

    def card(self) -> dict:
        """The bounds, as ``/v1/models`` lists them."""
        return {"max_loops": self.bound, "caps": list(self.caps),
                "exits": {name: {"tau": rule.tau} for name, rule in self.rules.items()}}

    def read(self, value: Any) -> tuple[Depth | None, dict]:
        """A request's ``rdepth`` object (None: absent) as the engine's depth and the policy the report echoes;
        :class:`BadRequest` naming the field (``rdepth.loops``, ``rdepth.exit``, ...) where it asks for what the
        server does not serve."""
        if value is None:
            return self.default, self.policy
        if not isinstance(value, dict):
            raise BadRequest("'rdepth' must be an object: {\"loops\": N} or {\"exit\": RULE, \"tau\": X, \"k_max\": N}",
                             "rdepth")
        unknown = sorted(set(value) - set(FIELDS), key=str)
        if unknown:
            raise BadRequest(f"unknown field(s) in 'rdepth': {', '.join(map(str, unknown))} (it takes "
                             f"{', '.join(FIELDS)})", f"rdepth.{unknown[0]}")
        loops, rule = value.get("loops"), value.get("exit")
        if (loops is None) == (rule is None):
            raise BadRequest("'rdepth' gives 'loops' (a fixed budget) or 'exit' (a rule), one of the two", "rdepth")
        if loops is not None:
            for name in ("tau", "k_max"):
                if value.get(name) is not None:
                    raise BadRequest(f"'rdepth.{name}' is for an exit rule; a fixed 'loops' takes none",
                                     f"rdepth.{name}")
            depth = Depth(loops=self._steps(loops, "loops"))
        else:
            depth = self._rule(rule, value.get("tau"), value.get("k_max"))
        policy = self.describe(depth)
        if policy == self.policy:  # the server's own policy: run as a request without a depth
            return self.default, self.policy
        return depth, policy

    def describe(self, depth: Depth) -> dict:
        """``depth`` as the report echoes it: ``{"loops": [per group]}`` or ``{"exit", "tau", "k_max": [per
        group], options...}`` (the shape of the server's own policy)."""
        if depth.loops is not None:
            return {"loops": [depth.loops] * len(self.caps)}
        rule = self.rules[depth.rule]
        caps = list(self.caps) if depth.k_max is None else [min(depth.k_max, cap) for cap in self.caps]
        tau = depth.tau if depth.tau is not None else rule.tau
        return {"exit": rule.name, "tau": tau, "k_max": caps, **rule.echoed_options()}

    def _steps(self, value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"'rdepth.{name}' must be an integer, got {value!r}", f"rdepth.{name}")
        if not 1 <= value <= self.bound:
            raise BadRequest(f"'rdepth.{name}' must be in [1, {self.bound}] (this server's most loop steps: "
                             f"--max-loops), got {value!r}", f"rdepth.{name}")
        return value

    def _rule(self, name: Any, tau: Any, k_max: Any) -> Depth:
        if not isinstance(name, str):
            raise BadRequest(f"'rdepth.exit' must be an exit rule's name, got {name!r}", "rdepth.exit")
        rule = self.rules.get(name)
        if rule is None:
            from rdepth.exits.base import POLICIES

            allowed = ", ".join(self.rules) or "none (--allow-exits)"
            known = "" if name in POLICIES else " is not an exit rule and"
            raise BadRequest(f"'rdepth.exit' {name!r}{known} is not one this server allows (it allows: {allowed})",
                             "rdepth.exit")
        steps = self.k_max if k_max is None else self._steps(k_max, "k_max")
        if tau is None:
            if rule.uses_tau and rule.tau is None:
                raise BadRequest(f"'rdepth.tau': the rule {name} needs a threshold and this server sets none for it",
                                 "rdepth.tau")
            # the rule's default threshold, given explicitly: a slot's next request never inherits another's
            return Depth(rule=name, tau=rule.tau if rule.per_row_tau else None, k_max=steps)
        if isinstance(tau, bool) or not isinstance(tau, (int, float)):
            raise BadRequest(f"'rdepth.tau' must be a number, got {tau!r}", "rdepth.tau")
        if not rule.uses_tau:
            raise BadRequest(f"'rdepth.tau': the rule {name} takes no threshold", "rdepth.tau")
        if not rule.per_row_tau:
            if tau != rule.tau:
                raise BadRequest(f"'rdepth.tau': the rule {name} runs at the server's threshold {rule.tau:g} only "
                                 "(it takes none per request)", "rdepth.tau")
            return Depth(rule=name, k_max=steps)
        from rdepth.exits.registry import get_policy_class

        try:
            tau = get_policy_class(name).checked_tau(tau)
        except RdepthError as exc:
            raise BadRequest(f"'rdepth.tau': {exc}", "rdepth.tau") from None
        return Depth(rule=name, tau=tau, k_max=steps)


def _own_caps(config, model) -> tuple[int, ...]:
    """The server's own loop budget (``--loops``) or, under ``--exit``, its caps (``--k-max``), per group."""
    from rdepth.exits.config import resolve_k_max
    from rdepth.model.budget import resolve_budget

    if config.exit:
        return tuple(resolve_k_max("serve", config.k_max, model.n_groups, model.config.default_eval_loops))
    return tuple(resolve_budget(model, config.loops or None, None).counts)


def _caps(config, own: tuple[int, ...]) -> tuple[int, ...]:
    """The engine's caps: ``--max-loops`` in every group, or the server's own (see :func:`build_engine`)."""
    if config.max_loops is None:
        return own
    caps = (config.max_loops,) * len(own)
    what = "--k-max" if config.exit else "loop budget"
    if any(cap < mine for cap, mine in zip(caps, own, strict=True)):
        raise RdepthError(f"serve: --max-loops {config.max_loops} is below the server's own {what} "
                          f"{','.join(map(str, own))} (the engine's caps hold every request)")
    if caps != own and len(set(own)) > 1:
        raise RdepthError(f"serve: --max-loops {config.max_loops} above a {what} that differs between groups "
                          f"({','.join(map(str, own))}) is not served: give one value for every group, or leave "
                          "--max-loops out (requests then ask for at most the smallest group's)")
    return caps


def allowed_rule(name: str, tau: float | None, options: dict, own: bool = False) -> AllowedRule:
    """An entry of ``--allow-exits`` checked (a known rule; a threshold it takes; a rule whose threshold is the
    server's alone has one): one-line errors. ``own``: the server's --exit rule at --tau (checked already)."""
    from rdepth.exits.registry import get_policy_class

    try:
        cls = get_policy_class(name)
    except RdepthError as exc:  # an unknown name: one line naming the rules there are
        raise RdepthError(f"serve: --allow-exits: {exc}") from None
    if not own and tau is not None:
        if not cls.uses_tau:
            raise RdepthError(f"serve: --allow-exits {name}:{tau:g}: the rule {name} takes no threshold")
        try:
            tau = cls.checked_tau(tau)
        except RdepthError as exc:
            raise RdepthError(f"serve: --allow-exits {name}:{tau:g}: {exc}") from None
    elif not own and cls.uses_tau and not cls.per_row_tau:
        raise RdepthError(f"serve: --allow-exits {name} needs its threshold ({name}:TAU): a request cannot set one "
                          "for this rule")
    return AllowedRule(name, tau, cls.uses_tau, cls.per_row_tau, cls.tau_max, dict(options))


def check_allowed(config, own_options: dict) -> list[AllowedRule]:
    """``--allow-exits`` read and checked before the checkpoint loads (names, thresholds, a gate of the run)."""
    from rdepth.exitrun.gate_file import check_gate_option
    from rdepth.run.config import policy_options

    allowed = []
    for name, tau in config.allowed_exits():
        if name == config.exit:
            allowed.append(allowed_rule(name, config.tau, own_options, own=True))
            continue
        rule = allowed_rule(name, tau, {})  # its name and threshold first
        options = policy_options("serve", name, None, config.checkpoint)
        check_gate_option(name, options, config.checkpoint)
        allowed.append(replace(rule, options=options))
    return allowed


def speculation(config) -> dict:
    """The engine's loop-speculation arguments from ``--speculate``, ``--draft-loops`` and ``--speculate-at-most``."""
    if config.speculate is None:
        return {}
    return {"speculate": config.speculate, "draft_loops": config.draft_loops or 1,
            "speculate_at_most": config.speculate_at_most}


def build_engine(config, model, context: int, allowed: list[AllowedRule], own_options: dict) -> tuple[Engine, Depths]:
    """The engine behind ``rdepth serve`` and the :class:`Depths` requests are read against.

    Its caps: ``--max-loops`` in every group, or the server's own budget (``--loops``) or ``--k-max``. Its
    named rules: those of ``--allow-exits``, each built at those caps (a rule a request names without a
    threshold runs at the server's: ``RULE:TAU``, or ``--tau`` for its own ``--exit``; without ``k_max``, at
    the server's own caps). Where the caps are the server's own, a request without a depth runs the engine's
    own controller: the server's policy. Above them (``--max-loops`` higher) every request brings a depth: one
    without runs the server's policy as its own (``Depth(loops=N)``, or its rule by name capped at ``--k-max``),
    and the engine's own controller, which no row then runs, is the cheapest."""
    from rdepth.exits.controller import controller_factory

    own = _own_caps(config, model)
    caps = _caps(config, own)
    moved = caps != own
    readout = lambda: model.readout  # noqa: E731

    def rule_factory(rule: AllowedRule):
        # A rule a request must give its threshold for is built at one it never runs (each row gets its own).
        tau = rule.tau if rule.tau is not None or not rule.uses_tau else (rule.tau_max or 1.0)
        return controller_factory(rule.name, tau, caps, readout, rule.options)

    rules = {rule.name: rule_factory(rule) for rule in allowed}
    default = None
    if config.exit:
        own_rule = allowed_rule(config.exit, config.tau, own_options, own=True)
        policy = {"exit": config.exit, "tau": config.tau, "k_max": list(own), **own_rule.echoed_options()}
        if moved:
            rules.setdefault(config.exit, rule_factory(own_rule))  # the server's rule by name, for the default
            default = Depth(rule=config.exit, tau=config.tau if own_rule.per_row_tau else None, k_max=own[0])
    else:
        policy = {"loops": list(own)}
        default = Depth(loops=own[0]) if moved else None
    if config.exit and not moved:
        budget = {"controller_factory": controller_factory(config.exit, config.tau, caps, readout, own_options)}
    else:
        budget = {"loop_counts": caps}
    engine = Engine(model, config.batch_size, kv_layout=config.kv_layout, capacity=context, tick=config.tick,
                    rules=rules, own_depths=True, ahead=config.ahead, **budget, **speculation(config))
    # (a rule's cap where a request gives none: the server's own; above the engine's caps only with one value)
    return engine, Depths(caps, {rule.name: rule for rule in allowed}, default, policy, own[0] if moved else None)
