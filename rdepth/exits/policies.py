"""The exit rules: the paper's three (§4, Eq. 3-6, Algorithm 1) and Geiping et al.'s others.

Notation: after loop step ``s`` a looping token has ``prev = x^(s-1)`` and
``new = x^(s)``; its newest update is ``Delta = new - prev`` (the paper's
``Delta^(s-1)``). Norms are Euclidean over the hidden dimension, computed in
float32 (float64 for float64 states). Every rule stops a token whose signal is
strictly below ``tau``; a larger ``tau`` exits earlier.

Latent rules (O(d) per token-step, never decode the vocabulary):

* ``fixed``: no rule, every token runs ``k_max`` steps (the fixed budget).
* ``step_norm``: ``||Delta|| < tau`` (Eq. 3); hands on ``new``.
* ``step_norm_rel``: ``||Delta|| / (||x^(s-1)|| + eps) < tau``.
* ``acceleration``: ``a = ||Delta^(s-1) - Delta^(s-2)||`` (Eq. 5), defined from
  step 2 on; exits when ``a < tau`` on two consecutive steps, handing on the
  state before the second hit's step, exactly as Algorithm 1.
* ``acceleration_rel``: the bounded form of Eq. 6,
  ``a / (||Delta^(s-1)|| + ||Delta^(s-2)|| + eps)`` in ``[0, 2]``, same two hits.
* ``acceleration_state``: ``a / (||x^(s-1)|| + eps)``, same two hits.
* ``cosine``: ``1 - cos(x^(s), x^(s-1)) < tau`` (consecutive states).
* ``latent_diff``: ``||Delta|| / (||x^(s)|| + eps) < tau`` (the newer state's norm below; eps 0 by
  default): Geiping et al.'s ``latent-diff`` criterion. Step 1 compares with the start state, so it
  can stop at step 1.

Decoded rules (O(V) per token-step through ``decode``: by default the final
norm + head, a logit-lens reading of a middle group; :mod:`rdepth.exits.decode`
also reads through the remaining layers; the initial state ``s0`` is never
decoded, so their first comparison is at step 2):

* ``kl``: by default (``direction="new_old"``)
  ``KL(p^(s) || p^(s-1)) = sum_v p^(s)_v (log p^(s)_v - log p^(s-1)_v)``, the
  paper's Eq. 4 (the newer distribution first). ``direction="old_new"`` is
  ``KL(p^(s-1) || p^(s))``, what Geiping et al.'s released code computes
  (``F.kl_div(log_p_new, log_p_old, log_target=True)``). Log-softmax in float32.
  ``prior="uniform"`` also reads the first state and compares it with the uniform distribution over
  the head's V outputs, as Geiping et al.'s code starts (so a token can stop at step 1); the default
  ``prior="none"`` never compares the first reading.
* ``minp_kl``: the same KL (default ``direction="old_new"``, ``prior="uniform"``: Geiping et al.'s
  ``minp-kl``) between min-p filtered distributions: every probability under ``min_p`` (0.1) times
  the largest is set to ``1/V``, then the distribution is renormalised.
* ``entropy_diff``: ``|H(p^(s)) - H(p^(s-1))| < tau`` (nats).
* ``argmax_stable``: no tau; exits when the top token has not changed for
  ``patience`` consecutive steps.

* ``confidence``: ``1 - max_v p^(s)_v < tau`` (``signal="max_prob"``, the default) or
  ``1 - (p^(s)_(1) - p^(s)_(2)) < tau`` (``signal="margin"``, the top two probabilities); no memory
  across steps, so it decodes ``x^(1)`` and can stop at step 1. ``tau`` in (0, 1].

Learned rule (O(d) per token-step; a head trained for one model, :mod:`rdepth.exits.gate`):

* ``learned``: a gate's probability ``p`` that the token's prediction will not change from here;
  exits when ``1 - p < tau`` (``p > 1 - tau``), from step 1 on; ``tau`` in (0, 1]. Its ``gate``
  option is a run or checkpoint folder holding ``exit_gate.safetensors`` (loaded and checked against
  that model) or an :class:`~rdepth.exits.gate.ExitGate`.

Ouro's rule (O(d) per token-step; the model's own gate, trained with it: ``ModelConfig.exit_gate``):

* ``ouro``: after step ``s`` the gate gives ``lambda_s = sigmoid(w . x^(s) + b)``, the probability of
  exiting at ``s`` given the token got there; the exit distribution is ``p_s = lambda_s * prod_{j<s}
  (1 - lambda_j)`` and a token stops at the first step whose cumulative ``sum_{j<=s} p_j`` reaches
  ``1 - tau`` (the reference's ``exit_threshold`` q = 1 - tau), else at ``k_max``, as the reference's
  ``OuroForCausalLM.forward(exit_threshold=q)`` chooses. ``tau`` in (0, 1]; option ``gate``: the model, a
  run or checkpoint folder of an imported Ouro, or a ``(weight [1, d], bias [1])`` pair.

``kl`` and ``entropy_diff`` take ``every=k``: the head is read at every k-th step only and the rule
compares consecutive readings (KL off the hot path; ``bench/exit_wall.py`` reports its agreement
with the exact rule).
"""

from __future__ import annotations

import importlib
import math
import os

import torch
import torch.nn.functional as F

from rdepth.errors import RdepthError
from rdepth.exits.base import ExitPolicy, compute_dtype, register_policy
from rdepth.exits.gate import ExitGate


def _norm(x: torch.Tensor) -> torch.Tensor:
    """Row norms ``[A]`` of ``x`` ``[A, d]``."""
    return torch.linalg.vector_norm(x, dim=-1)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the rules' compute dtype (float32, or float64 for float64 states); no call when it is."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _check_eps(policy: ExitPolicy) -> None:
    eps = policy.options["eps"]
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise RdepthError(f"exit policy {policy.name}: eps must be a number >= 0, got {eps!r}")


@register_policy
class FixedPolicy(ExitPolicy):
    """Every token runs exactly ``k_max`` steps."""

    step_free = True
    name = "fixed"
    uses_tau = False

    def _exits(self, step, rows, prev, new):
        return torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)


@register_policy
class StepNormPolicy(ExitPolicy):
    """``||x^(s) - x^(s-1)|| < tau`` (Eq. 3)."""

    step_free = True
    name = "step_norm"

    def _exits(self, step, rows, prev, new):
        return self._below(_norm(_wide(new) - _wide(prev)), rows)


class _EpsPolicy(ExitPolicy):
    """A rule with a small ``eps`` (>= 0) in a denominator."""

    option_defaults = {"eps": 1e-6}

    def _validate_options(self) -> None:
        _check_eps(self)


@register_policy
class StepNormRelPolicy(_EpsPolicy):
    """``||x^(s) - x^(s-1)|| / (||x^(s-1)|| + eps) < tau`` (scale-free step norm)."""

    step_free = True
    name = "step_norm_rel"

    def _exits(self, step, rows, prev, new):
        prev = _wide(prev)
        ratio = _norm(_wide(new) - prev) / (_norm(prev) + self.options["eps"])
        return self._below(ratio, rows)


class _TwoHitPolicy(ExitPolicy):
    """Algorithm 1's state machine around a second-order signal.

    Per token: the previous update ``Delta`` (``[N, d]``) and whether the
    previous step was a hit (``[N]``). A token exits when the signal is below
    ``tau`` on two consecutive steps and then hands on ``x^(s-1)``.
    """

    hands_on_previous = True
    option_defaults = {"eps": 1e-6}

    def _validate_options(self) -> None:
        _check_eps(self)

    def _signal(self, delta: torch.Tensor, prev_delta: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Per-token signal ``[A]`` from the newest and previous updates."""
        raise NotImplementedError

    def _reset(self, state):
        dtype = compute_dtype(state)
        self.prev_delta = torch.zeros(state.shape, dtype=dtype, device=state.device)
        self.prev_small = torch.zeros(state.shape[0], dtype=torch.bool, device=state.device)

    def _reset_rows(self, rows, state):
        self.prev_small[rows] = False

    @property
    def one_call(self) -> bool:
        return True

    def after_steps(self, steps, values, rows, prev, new):
        """Rows at different steps in one call (the engine's static tick): a row at step 1 has no previous update,
        so it keeps its hit flag as begun (no hit: it cannot exit there), as :meth:`_exits` at step 1."""
        if len(values) == 1:
            return super().after_steps(steps, values, rows, prev, new)
        self._check_steps(values)
        exits = self._hits(rows, prev, new, steps == 1)
        return exits | (steps == self.k_max), torch.where(exits[:, None], prev, new), steps - exits.long()

    def _exits(self, step, rows, prev, new):
        return self._hits(rows, prev, new, step == 1)

    def _hits(self, rows, prev, new, first: bool | torch.Tensor) -> torch.Tensor:
        """The second hit in a row of the rows ``rows``, and their memory moved on; ``first``: the rows at step 1
        (one bool for them all, or per row ``[A]``), which have no previous update: no hit, the flag as begun."""
        prev = _wide(prev)
        delta = _wide(new) - prev  # (A, d)
        if first is True:  # no previous update yet
            exits = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
        else:
            small = self._below(self._signal(delta, self.prev_delta[rows], prev), rows)
            was_small = self.prev_small[rows]
            exits = small & was_small
            self.prev_small[rows] = small if first is False else torch.where(first, was_small, small)
        self.prev_delta[rows] = delta
        return exits


@register_policy
class AccelerationPolicy(_TwoHitPolicy):
    """``||Delta^(k) - Delta^(k-1)|| < tau`` twice in a row (Eq. 5, Algorithm 1)."""

    name = "acceleration"
    option_defaults = {}

    def _validate_options(self) -> None:
        pass

    def _signal(self, delta, prev_delta, prev):
        return _norm(delta - prev_delta)


@register_policy
class AccelerationRelPolicy(_TwoHitPolicy):
    """Bounded acceleration of Eq. 6: ``a / (||Delta^(k)|| + ||Delta^(k-1)|| + eps)``."""

    name = "acceleration_rel"

    def _signal(self, delta, prev_delta, prev):
        return _norm(delta - prev_delta) / (_norm(delta) + _norm(prev_delta) + self.options["eps"])


@register_policy
class AccelerationStatePolicy(_TwoHitPolicy):
    """Acceleration normalised by the state: ``a / (||x^(k)|| + eps)``, ``x^(k) = prev``."""

    name = "acceleration_state"

    def _signal(self, delta, prev_delta, prev):
        return _norm(delta - prev_delta) / (_norm(prev) + self.options["eps"])


@register_policy
class CosinePolicy(_EpsPolicy):
    """``1 - cos(x^(s), x^(s-1)) < tau``: consecutive states point the same way."""

    step_free = True
    name = "cosine"
    option_defaults = {"eps": 1e-8}

    def _exits(self, step, rows, prev, new):
        cosine = F.cosine_similarity(_wide(new), _wide(prev), dim=-1, eps=self.options["eps"])
        return self._below(1.0 - cosine, rows)


@register_policy
class LatentDiffPolicy(_EpsPolicy):
    """``||x^(s) - x^(s-1)|| / (||x^(s)|| + eps) < tau``: Geiping et al.'s ``latent-diff`` (their default
    tau 0.03), the newer state's norm below."""

    step_free = True
    name = "latent_diff"
    option_defaults = {"eps": 0.0}

    def _exits(self, step, rows, prev, new):
        new = _wide(new)
        return self._below(_norm(new - _wide(prev)) / (_norm(new) + self.options["eps"]), rows)


class _DecodedPolicy(ExitPolicy):
    """Rules on the decoded distribution ``p^(s) = softmax(decode(x^(s)))``.

    ``every`` (option, default 1): the head is read at every ``every``-th loop step only (steps
    ``every``, ``2 * every``, ...) and the rule compares consecutive readings, so the O(V) work of a
    token is 1/every of the exact rule's; a token can then exit only at those steps."""

    needs_decode = True

    def _check_every(self) -> None:
        every = self.options["every"]
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise RdepthError(f"exit policy {self.name}: every must be a positive integer, got {every!r}")

    def _reads(self, step: int) -> bool:
        """Whether the head is read after loop step ``step``."""
        return step % self.options["every"] == 0

    def _first_reading(self, step: int) -> bool:
        return step == self.options["every"]

    def _log_probs(self, new: torch.Tensor) -> torch.Tensor:
        logits = self.decode(new)  # (A, V)
        return torch.log_softmax(logits.to(compute_dtype(logits)), dim=-1)


@register_policy
class KLPolicy(_DecodedPolicy):
    """``KL(p^(s) || p^(s-1)) < tau`` (Eq. 4, ``direction="new_old"``, the default) or
    ``KL(p^(s-1) || p^(s)) < tau`` (``direction="old_new"``, Geiping et al.'s code); keeps the
    previous log-probs ``[N, V]``. ``prior="uniform"``: the first reading is compared with the uniform
    distribution (Geiping et al.'s start) instead of never."""

    name = "kl"
    option_defaults = {"direction": "new_old", "every": 1, "prior": "none"}
    DIRECTIONS = ("new_old", "old_new")
    PRIORS = ("none", "uniform")

    def _validate_options(self) -> None:
        self._check_every()
        for option, allowed in (("direction", self.DIRECTIONS), ("prior", self.PRIORS)):
            if self.options[option] not in allowed:
                raise RdepthError(f"exit policy {self.name}: {option} must be one of {', '.join(allowed)}, "
                                  f"got {self.options[option]!r}")

    def _reset(self, state):
        self.prev_log_probs: torch.Tensor | None = None

    def _reset_rows(self, rows, state):
        if self.prev_log_probs is not None:  # as first made: the uniform prior's, or zeros
            vocab = self.prev_log_probs.shape[-1]
            self.prev_log_probs[rows] = -math.log(vocab) if self.options["prior"] == "uniform" else 0.0

    def _distribution(self, new: torch.Tensor) -> torch.Tensor:
        """The log-probabilities the rule compares ``[A, V]``."""
        return self._log_probs(new)

    @property
    def one_call(self) -> bool:
        return self.options["every"] == 1

    def after_steps(self, steps, values, rows, prev, new):
        """Rows at different steps in one call when the head is read at every step (``every`` 1): the first
        reading (step 1) compares with the prior or exits never, as :meth:`_exits` at step 1."""
        if self.options["every"] != 1 or len(values) == 1:
            return super().after_steps(steps, values, rows, prev, new)
        self._check_steps(values)
        log_probs = self._distribution(new)  # (A, V)
        kl = self._kl(log_probs, rows)
        exits = self._below(kl, rows)
        if self.options["prior"] != "uniform":
            exits = exits & (steps != 1)
        self.prev_log_probs[rows] = log_probs
        return exits | (steps == self.k_max), new, steps

    def _kl(self, log_probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``[A]``: the divergence between each row's reading and its previous one (the prior's at first)."""
        if self.prev_log_probs is None:
            vocab = log_probs.shape[-1]
            uniform = self.options["prior"] == "uniform"
            self.prev_log_probs = log_probs.new_full((self.n_rows, vocab), -math.log(vocab) if uniform else 0.0)
        prev_log_probs = self.prev_log_probs[rows]
        if self.options["direction"] == "new_old":
            return (log_probs.exp() * (log_probs - prev_log_probs)).sum(-1)
        return (prev_log_probs.exp() * (prev_log_probs - log_probs)).sum(-1)

    def _exits(self, step, rows, prev, new):
        if not self._reads(step):
            return torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
        log_probs = self._distribution(new)  # (A, V)
        if self._first_reading(step) and self.options["prior"] != "uniform":
            if self.prev_log_probs is None:
                self._kl(log_probs, rows)  # allocates the memory
            exits = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
        else:
            exits = self._below(self._kl(log_probs, rows), rows)
        self.prev_log_probs[rows] = log_probs
        return exits


@register_policy
class MinpKLPolicy(KLPolicy):
    """``kl`` between min-p filtered distributions (Geiping et al.'s ``minp-kl``, their default tau 1e-5):
    probabilities under ``min_p`` times the largest become ``1/V``, then all are renormalised."""

    name = "minp_kl"
    option_defaults = {"direction": "old_new", "every": 1, "prior": "uniform", "min_p": 0.1}

    def _validate_options(self) -> None:
        super()._validate_options()
        min_p = self.options["min_p"]
        if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0 < min_p <= 1:
            raise RdepthError(f"exit policy {self.name}: min_p must be in (0, 1], got {min_p!r}")

    def _distribution(self, new: torch.Tensor) -> torch.Tensor:
        probs = self._log_probs(new).exp()
        floor = self.options["min_p"] * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(probs < floor, torch.full_like(probs, 1.0 / probs.shape[-1]), probs)
        return (probs / probs.sum(dim=-1, keepdim=True)).log()


@register_policy
class EntropyDiffPolicy(_DecodedPolicy):
    """``|H(p^(s)) - H(p^(s-1))| < tau``, entropies in nats."""

    name = "entropy_diff"
    option_defaults = {"every": 1}

    def _validate_options(self) -> None:
        self._check_every()

    def _reset(self, state):
        self.prev_entropy = torch.zeros(state.shape[0], dtype=torch.float64, device=state.device)

    def _reset_rows(self, rows, state):
        self.prev_entropy[rows] = 0.0

    def _exits(self, step, rows, prev, new):
        if not self._reads(step):
            return torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
        log_probs = self._log_probs(new)
        entropy = -(log_probs.exp() * log_probs).sum(-1).to(torch.float64)
        if self._first_reading(step):
            exits = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
        else:
            exits = self._below((entropy - self.prev_entropy[rows]).abs(), rows)
        self.prev_entropy[rows] = entropy
        return exits


@register_policy
class ArgmaxStablePolicy(_DecodedPolicy):
    """Exit when the top token has stayed the same for ``patience`` consecutive steps."""

    step_free = True
    name = "argmax_stable"
    uses_tau = False
    option_defaults = {"patience": 2}
    sweep_parameter = "patience"
    default_grid = (1, 2, 3)

    def _validate_options(self) -> None:
        patience = self.options["patience"]
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise RdepthError(f"exit policy {self.name}: patience must be a positive integer, got {patience!r}")

    def _reset(self, state):
        self.prev_top = torch.full((state.shape[0],), -1, dtype=torch.long, device=state.device)
        self.streak = torch.zeros(state.shape[0], dtype=torch.long, device=state.device)

    def _reset_rows(self, rows, state):
        self.prev_top[rows] = -1
        self.streak[rows] = 0

    def _exits(self, step, rows, prev, new):
        top = self.decode(new).argmax(dim=-1)  # (A,)
        same = top == self.prev_top[rows]  # never true at step 1 (prev_top = -1)
        streak = torch.where(same, self.streak[rows] + 1, torch.zeros_like(top))
        self.prev_top[rows] = top
        self.streak[rows] = streak
        return streak >= self.options["patience"]


@register_policy
class ConfidencePolicy(_DecodedPolicy):
    """Exit when the decoded prediction is confident: ``1 - max_v p^(s)_v < tau`` (``signal="max_prob"``)
    or ``1 - (p_(1) - p_(2)) < tau`` (``signal="margin"``, the top two probabilities).

    Reads ``x^(s)`` after every step from step 1 (never the random start) and keeps nothing between
    steps, so a token whose first iterate already decodes confidently stops at step 1. Cost per
    token-step: the head, O(d V) (the ``decode``), then O(V) for the log-softmax and the top one or two;
    O(1) memory per token. Per row, no host read. ``tau`` in (0, 1] (a probability's complement)."""

    step_free = True
    name = "confidence"
    tau_max = 1.0
    option_defaults = {"signal": "max_prob"}
    SIGNALS = ("max_prob", "margin")

    def _validate_options(self) -> None:
        if self.options["signal"] not in self.SIGNALS:
            raise RdepthError(f"exit policy {self.name}: signal must be one of {', '.join(self.SIGNALS)}, "
                              f"got {self.options['signal']!r}")

    def _exits(self, step, rows, prev, new):
        log_probs = self._log_probs(new)  # (A, V)
        if self.options["signal"] == "max_prob":
            unsure = 1.0 - log_probs.max(dim=-1).values.exp()
        else:
            top = log_probs.topk(min(2, log_probs.shape[-1]), dim=-1).values.exp()  # (A, 2)
            unsure = 1.0 - (top[:, 0] - top[:, -1]) if top.shape[-1] == 2 else 1.0 - top[:, 0]
        return self._below(unsure, rows)


@register_policy
class LearnedPolicy(ExitPolicy):
    """Exit when a trained gate says the token's prediction will not change from here: ``1 - p < tau``,
    i.e. the gate's probability ``p`` exceeds ``1 - tau`` (:mod:`rdepth.exits.gate`), decided on its score
    ``z`` as ``z > log((1 - tau) / tau)`` (tau 1: every token stops at step 1).

    ``gate`` (option, required): a run or checkpoint folder whose ``exit_gate.safetensors`` was trained for
    that model (``rdepth gate``), or an :class:`~rdepth.exits.gate.ExitGate`. Reads the group's head on
    ``x^(s-1)`` and ``x^(s)`` from step 1: O(d) per token-step, no memory across steps, per row, no
    host read. ``tau`` in (0, 1]."""

    step_free = True
    name = "learned"
    per_row_tau = False  # (its threshold is derived once: a score floor)
    tau_max = 1.0
    trained = True
    option_defaults = {"gate": None}

    def _validate_options(self) -> None:
        gate = self.options["gate"]
        if gate is None:
            raise RdepthError(f"exit policy {self.name}: needs a trained exit gate (option gate: a run or checkpoint "
                              "folder holding exit_gate.safetensors, made by rdepth gate)")
        if isinstance(gate, (str, os.PathLike)):
            gate = _gate_of_run(gate)
        elif not isinstance(gate, ExitGate):
            raise RdepthError(f"exit policy {self.name}: gate must be a run folder or an ExitGate, "
                              f"got {type(gate).__name__}")
        self.gate = gate

    def describe(self):
        described = super().describe()
        gate = getattr(self, "gate", None)
        described["gate"] = None if gate is None else gate.source or "in memory"
        return described

    def _reset(self, state):
        self.gate.check_state(self.group, state)
        # 1 - sigmoid(z) < tau  <=>  z > log((1 - tau) / tau): the score against a constant (no sigmoid)
        self.score_floor = math.log((1.0 - self.tau) / self.tau) if self.tau < 1.0 else -math.inf

    def _exits(self, step, rows, prev, new):
        return self.gate.score(self.group, prev, new) > self.score_floor


def _gate_of_run(folder: str | os.PathLike) -> ExitGate:
    """The gate saved beside ``folder``'s checkpoint (:func:`rdepth.exitrun.gate_file.load_gate`), imported when
    asked for: the exported model's bundled code carries the rules without rdepth's run-folder code, so there
    a gate comes as an :class:`ExitGate` (a folder is a one-line error)."""
    try:
        gate_file = importlib.import_module("rdepth.exitrun.gate_file")
    except ImportError:
        raise RdepthError("exit policy learned: a gate file needs rdepth installed; pass an ExitGate") from None
    return gate_file.load_gate(folder)


@register_policy
class OuroPolicy(ExitPolicy):
    """Ouro's learned exit (ByteDance's LoopLM): the gate's per-step exit probabilities ``lambda_s =
    sigmoid(w . x^(s) + b)`` accumulated into the exit distribution ``p_s = lambda_s * R_{s-1}``,
    ``R_s = R_{s-1} (1 - lambda_s)``, ``R_0 = 1``; a token stops at the first step where ``sum p`` reaches
    ``q = 1 - tau``. The arithmetic is the reference's, in its order (``p = lambda * R``, then ``R * (1 -
    lambda)``, the sum added step by step as its ``cumsum``), in float32 (float64 for float64 states), so
    equal gate scores give equal stops. Its last step's ``p`` (the rest of the mass) decides nothing: a
    token at ``k_max`` stops anyway. Per row, no host read."""

    step_free = True
    name = "ouro"
    tau_max = 1.0
    per_row_tau = False  # (its threshold is derived once: 1 - tau)
    trained = True
    option_defaults = {"gate": None}

    def _validate_options(self) -> None:
        self.weight, self.bias = _ouro_gate(self.options["gate"])
        self.threshold = 1.0 - self.tau  # the reference's exit_threshold, compared as it compares it

    def describe(self):
        described = super().describe()
        gate = self.options["gate"]
        described["gate"] = str(gate) if isinstance(gate, (str, os.PathLike)) else "in memory"
        return described

    def _reset(self, state):
        if state.shape[-1] != self.weight.shape[-1]:
            raise RdepthError(f"exit policy {self.name}: the gate reads {self.weight.shape[-1]} dimensions, the loop "
                              f"state has {state.shape[-1]}")
        dtype = compute_dtype(state)
        self.remaining = torch.ones(state.shape[0], dtype=dtype, device=state.device)
        self.cdf = torch.zeros(state.shape[0], dtype=dtype, device=state.device)
        self._gate = (self.weight.to(state.device, dtype), self.bias.to(state.device, dtype))

    def _reset_rows(self, rows, state):
        self.remaining[rows] = 1.0
        self.cdf[rows] = 0.0

    def _exits(self, step, rows, prev, new):
        weight, bias = self._gate
        lam = torch.sigmoid(F.linear(new.to(weight.dtype), weight, bias).squeeze(-1))  # (A,)
        remaining = self.remaining[rows]
        cdf = self.cdf[rows] + lam * remaining
        self.remaining[rows] = remaining * (1.0 - lam)
        self.cdf[rows] = cdf
        return cdf >= self.threshold


def _ouro_gate(gate) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [1, d], bias [1])`` of Ouro's gate from a model with ``exit_gate``, a ``Linear(d, 1)``, a pair,
    or a run / checkpoint folder (its ``model.safetensors``'s ``exit_gate`` tensors, read alone)."""
    if gate is None:
        raise RdepthError("exit policy ouro: needs the model's exit gate (option gate: an imported Ouro run or "
                          "checkpoint folder, or the model)")
    if isinstance(gate, (str, os.PathLike)):
        return _ouro_gate_of_run(gate)
    gate = getattr(gate, "exit_gate", gate) if not isinstance(gate, tuple) else gate
    if gate is None:
        raise RdepthError("exit policy ouro: the model has no exit gate (ModelConfig.exit_gate is false)")
    weight, bias = (gate.weight, gate.bias) if isinstance(gate, torch.nn.Linear) else gate
    weight, bias = torch.as_tensor(weight).detach(), torch.as_tensor(bias).detach()
    if weight.dim() != 2 or weight.shape[0] != 1 or tuple(bias.shape) != (1,):
        raise RdepthError(f"exit policy ouro: the gate must be weight [1, d] and bias [1], got "
                          f"{tuple(weight.shape)} and {tuple(bias.shape)}")
    return weight, bias


def _ouro_gate_of_run(folder: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        checkpoint = importlib.import_module("rdepth.run.checkpoint")
    except ImportError:
        raise RdepthError("exit policy ouro: a run folder needs rdepth installed; pass the model") from None
    path = checkpoint.resolve_checkpoint(folder) / "model.safetensors"
    try:
        with safe_open(str(path), framework="pt") as handle:
            if "exit_gate.weight" not in handle.keys():  # noqa: SIM118 (a safetensors handle is no mapping)
                raise RdepthError(f"exit policy ouro: {path.parent} has no exit gate (import an Ouro folder, whose "
                                  "model has one)")
            return _ouro_gate((handle.get_tensor("exit_gate.weight"), handle.get_tensor("exit_gate.bias")))
    except (SafetensorError, OSError) as exc:
        raise RdepthError(f"exit policy ouro: cannot read {path} ({exc})") from None


def random_ouro_gate(width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A gate for the ``ouro`` rule with random weights (``[1, width]`` ~ N(0, 1/width), bias N(0, 1)): the
    rule's mechanics on any model (tests), not its quality."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, width, generator=generator) / math.sqrt(width), torch.randn(1, generator=generator))
