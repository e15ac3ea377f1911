"""Loop-speculative decoding on the one decoder: draft with few loop steps, verify at the full depth, lossless.

A looped model is its own draft model: the same weights at a smaller loop budget. Each *round*

1. **drafts** K tokens one at a time at the draft budget: D loop steps per group (at most the verifying
   budget's), or under an exit rule the same rule capped at D steps per group (:class:`CappedController`:
   the loop routine stops every row at the cap with the rule's own hand-off, which is the rule built with
   ``k_max = D``);
2. **verifies** them in one pass at the verifying budget or exit rule: the last decided token and the drafts
   run through :meth:`Decoder.extend` in lock-step (``lockstep=True``: under an exit rule each position
   loops as a packed row and stops on its own; its keys are written through to the later step slots as they
   are computed, so the pass leaves what one-at-a-time decoding leaves);
3. **keeps** the longest prefix of drafts the verifier agrees with (greedy) or accepts by rejection sampling
   (sampled: draft ``x ~ q`` kept with probability ``min(1, p(x) / q(x))``, else the token is drawn from
   ``max(p - q, 0)`` normalised; the output is distributed as the verifying budget's), and adds the
   verifier's own next token (its correction, or after K kept drafts a bonus token from the last position);
4. **rolls back** the cache to the positions decided: they hold the verifying pass's keys, which are what
   plain decoding at the verifying budget holds (the latest-KV rule for exited tokens included); the
   drafts' entries past them are overwritten before anything reads them.

**How a draft reads the cache.** A draft token at position p runs D steps per group; at step k it attends
to the step-k slots of every earlier position. For the positions before the round these hold the
*verifier's* keys (its step-k keys, or the latest of a token that stopped before k), not what a D-step
model would have computed; for the round's earlier drafts, the drafts' own step-k keys. So a draft is the
D-step continuation of the verified sequence, and its keys are never kept: verification recomputes every
position it keeps. (In the first group, with nothing but single-pass layers before it, steps 1..D of a
position are the verifier's steps 1..D exactly; later groups read a different input.)

Greedy tokens are plain greedy decoding's at the verifying budget (:meth:`Decoder.generate`, to float
rounding between the lock-step and one-at-a-time passes); sampled tokens have plain sampling's
distribution, and with a draft equal to the verifier they are plain sampling's tokens: drafts and the
bonus token draw from ``rng`` (one draw per position, as plain sampling), the acceptance tests and
corrections from ``accept_rng``. One sequence at a time (batch 1); not with warm start (a verifier would
need the drafts' handed-on states).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rdepth.config import parse_loop_counts
from rdepth.errors import RdepthError
from rdepth.model.budget import Budget, resolve_budget
from rdepth.model.control import FixedController, LoopController
from rdepth.model.decoder import Decoder
from rdepth.model.noise import StateNoise
from rdepth.model.recurrent import RecurrentLM
from rdepth.model.sampling import choose_tokens, token_probabilities


@dataclass
class SpeculativeStats:
    """``rounds``: verification passes; ``drafted``/``accepted``: draft tokens made and kept."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        """Drafts kept per draft made."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Drafts kept per verification pass (each pass adds one token more: the verifier's own)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    def add(self, other: SpeculativeStats) -> None:
        """Count ``other``'s rounds and drafts too (several decodes' together)."""
        self.rounds, self.drafted, self.accepted = (self.rounds + other.rounds, self.drafted + other.drafted,
                                                    self.accepted + other.accepted)

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance, "mean_accepted": self.mean_accepted}


class CappedController:
    """``controller`` with at most ``caps[g]`` loop steps in group g. The rule decides as it does; at the
    cap the loop routine (:func:`~rdepth.model.loop.stop_and_hand_on`) stops every row still looping with
    the hand-off the rule returned for that step, which is what the rule built with ``k_max = cap`` does
    (an exit policy reads its ``k_max`` only to stop there)."""

    def __init__(self, controller: LoopController, caps: Sequence[int]):
        self.controller, self.caps = controller, tuple(caps)

    def max_steps(self, group: int) -> int:
        return min(self.controller.max_steps(group), self.caps[group])

    def begin(self, group: int, state: torch.Tensor) -> None:
        self.controller.begin(group, state)

    def after_step(self, group, step, rows, prev, new):
        return self.controller.after_step(group, step, rows, prev, new)


def _budget_steps(model: RecurrentLM, budget: Budget) -> tuple[int, ...]:
    """The most loop steps per group a budget runs."""
    controller = FixedController(budget.counts) if budget.fixed else budget.controller_factory()
    return tuple(controller.max_steps(group) for group in range(model.n_groups))


def draft_budget(model: RecurrentLM, verify: Budget, draft_loops: Sequence[int] | int | str) -> Budget:
    """The draft budget for ``verify``: ``draft_loops`` D (N, or one per group) loop steps per group, at
    most the verifying budget's; under an exit rule, the rule capped at D. One-line errors: a model without
    loops, a rule that cannot be capped (a controller without the loop-controller methods), and a draft at
    or above the verifying budget in every group (nothing to draft)."""
    if model.n_groups == 0:
        raise RdepthError("speculative decoding drafts with fewer loop steps: the model has no loops")
    caps = parse_loop_counts(draft_loops, model.n_groups)
    if verify.fixed:
        counts = tuple(min(cap, count) for cap, count in zip(caps, verify.counts, strict=True))
        if counts == tuple(verify.counts):
            raise RdepthError(f"speculative decoding: the draft budget ({_shown(caps)} loop steps) is at or above "
                              f"the verifying budget ({_shown(verify.counts)}) in every group: nothing to draft")
        return Budget(counts=counts)
    sample = verify.controller_factory()
    missing = [name for name in ("max_steps", "begin", "after_step") if not callable(getattr(sample, name, None))]
    if missing:
        raise RdepthError(f"speculative decoding: the exit rule {type(sample).__name__} cannot be capped at "
                          f"--draft-loops (it has no {', '.join(missing)})")
    steps = _budget_steps(model, verify)
    if all(cap >= most for cap, most in zip(caps, steps, strict=True)):
        raise RdepthError(f"speculative decoding: the draft cap ({_shown(caps)} loop steps) is at or above the "
                          f"exit rule's own ({_shown(steps)}) in every group: nothing to draft")
    factory = verify.controller_factory
    return Budget(controller_factory=lambda: CappedController(factory(), caps))


def _shown(counts: Sequence[int]) -> str:
    return ",".join(str(count) for count in counts)


@dataclass(frozen=True)
class Sampling:
    """How a token is chosen from logits: ``temperature`` 0 greedy, else a draw from
    :func:`~rdepth.model.sampling.token_probabilities` with ``top_k`` / ``top_p``."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """``[N, V]`` logits -> ``[N, V]`` float probabilities."""
        return token_probabilities(logits, self.temperature, self.top_k, self.top_p)

    def choose(self, logits: torch.Tensor, rng: torch.Generator | None) -> int:
        """One token from ``[1, V]`` logits (as :func:`choose_tokens`, drawing from ``rng``)."""
        return int(choose_tokens(logits, self.temperature, self.top_k, rng, self.top_p))


def accept_drafts(verified: torch.Tensor, drafts: Sequence[int], draft_probs: torch.Tensor | None,
                  sampling: Sampling, accept_rng: torch.Generator | None) -> tuple[int, int | None]:
    """The verifier's decision on one round's ``drafts`` (k tokens): ``verified`` ``[m, V]`` the verifying
    pass's logits at the positions before each draft (and, where ``m > k``, before the token after them);
    ``draft_probs`` ``[k, V]`` the distributions the drafts were drawn from (sampling). Returns ``(kept,
    token)``: the drafts kept (a prefix) and the verifier's token after them where it differs from the next
    draft (greedy: its argmax; sampled: a draw from ``max(p - q, 0)`` normalised, from ``accept_rng``), None
    when every draft is kept (the caller draws the bonus token from the last position's logits)."""
    if sampling.greedy:
        choices = verified[: len(drafts)].float().argmax(dim=-1).tolist()
        for index, (choice, draft) in enumerate(zip(choices, drafts, strict=True)):
            if choice != draft:
                return index, choice
        return len(drafts), None
    target = sampling.probabilities(verified[: len(drafts)])  # p, [k, V]
    chosen = torch.tensor(drafts, device=target.device)[:, None]
    p_draft, q_draft = target.gather(1, chosen)[:, 0], draft_probs.gather(1, chosen)[:, 0]
    uniform = torch.rand(len(drafts), generator=accept_rng,
                         device=accept_rng.device if accept_rng is not None else None)
    kept = (uniform.to(target.device) * q_draft <= p_draft).tolist()  # accepted with probability min(1, p/q)
    for index, keep in enumerate(kept):
        if not keep:
            residual = (target[index] - draft_probs[index]).clamp_min(0)
            if float(residual.sum()) <= 0:  # p <= q everywhere means p == q: cannot reject; rounding only
                residual = target[index]
            token = torch.multinomial(residual / residual.sum(), 1, generator=accept_rng)
            return index, int(token)
    return len(drafts), None


@dataclass
class Round:
    """One round's outcome (:func:`speculation_round`): the ``drafts`` made, how many the verifier ``kept`` (a
    prefix), its own ``token`` after them (its correction, or the bonus token; None: every draft kept and no
    bonus wanted), the verifying pass's logits ``verified`` ``[m, V]`` at the positions from the round's first
    (row i: the logits after position ``start + i``), its loop steps per group there ``steps`` ``[G, m]``, and
    the loop steps the drafts computed per group ``draft_steps`` ``[G]``."""

    drafts: list[int]
    kept: int
    token: int | None
    verified: torch.Tensor
    steps: torch.Tensor
    draft_steps: torch.Tensor

    @property
    def decided(self) -> int:
        """Positions the round decided (read out at the verifying budget): the kept drafts' and the verifier's."""
        return self.kept + (self.token is not None)


@torch.no_grad()
def speculation_round(decoder: Decoder, token: int, count: int, bonus: bool, draft: Budget,
                      sampling: Sampling = Sampling(), rng: torch.Generator | None = None,
                      accept_rng: torch.Generator | None = None) -> Round:
    """One round on ``decoder`` (batch 1, its budget the verifying one), whose cache holds the positions before
    ``decoder.length`` at that budget and whose next token is ``token`` (decided): ``count`` drafts at ``draft``,
    verified in one pass with (``bonus``) or without the last draft fed (without: the round's last position is
    the last one wanted), kept or rejected (see the module). The decoder is left holding the positions the round
    decided (``token`` and the kept drafts; the verifier's own token is the next to go in)."""
    start = decoder.length
    drafts, probs, current = [], [], token
    draft_steps = torch.zeros_like(decoder.computed[:, 0])
    for _ in range(count):
        logits = decoder.step(torch.tensor([[current]], device=decoder.device), draft)
        draft_steps += decoder.computed[:, 0]
        if sampling.greedy:
            current = int(logits.float().argmax())
        else:
            probs.append(sampling.probabilities(logits))
            current = int(torch.multinomial(probs[-1], 1, generator=rng))
        drafts.append(current)
    decoder.rollback(start)
    fed = torch.tensor([[token, *drafts[: count if bonus else count - 1]]], device=decoder.device)
    verified = decoder.extend(fed, lockstep=True)[0]  # [count (+ 1), V]
    steps = decoder.prompt_computed[:, 0].clone()  # [G, count (+ 1)]
    kept, chosen = accept_drafts(verified, drafts, torch.cat(probs) if probs else None, sampling, accept_rng)
    if chosen is None and bonus:
        chosen = sampling.choose(verified[count:count + 1], rng)
    if chosen is not None:
        decoder.rollback(start + kept + 1)
    return Round(drafts, kept, chosen, verified, steps, draft_steps)


@torch.no_grad()
def speculate(decoder: Decoder, prompt: torch.Tensor, max_new_tokens: int, *, tokens: int, draft: Budget,
              sampling: Sampling = Sampling(), rng: torch.Generator | None = None,
              accept_rng: torch.Generator | None = None) -> tuple[torch.Tensor, SpeculativeStats]:
    """``prompt`` ``[1, T0]`` extended by up to ``max_new_tokens`` tokens (fewer where the decoder's capacity
    ends, as :meth:`Decoder.generate`) on ``decoder`` (batch 1, its budget the verifying one, its cache
    keeping the draft's steps too), drafting ``tokens`` K per round at ``draft`` (see the module). Returns the
    tokens ``[1, T0 + n]`` and the round statistics."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise RdepthError(f"speculative decoding drafts K >= 1 tokens per round, got {tokens!r}")
    if decoder.batch_size != 1 or prompt.dim() != 2 or prompt.shape[0] != 1:
        raise RdepthError(f"speculative decoding runs one sequence at a time, got a batch of shape "
                          f"{tuple(prompt.shape)} on a decoder of {decoder.batch_size} rows")
    if decoder.warm_start:
        raise RdepthError("speculative decoding with warm start is not supported (the verifier would need the "
                          "drafts' handed-on states)")
    prompt = prompt.to(decoder.device)
    stats = SpeculativeStats()
    if max_new_tokens < 1:
        return prompt, stats
    decoder.reset()
    sequence = prompt[0].tolist()
    total = min(len(sequence) + max_new_tokens, decoder.capacity + 1)  # as Decoder.generate stops
    sequence.append(sampling.choose(decoder.extend(prompt, lockstep=True)[:, -1], rng))
    # Invariant: the decoder holds positions < len(sequence) - 1 at the verifying budget; the last token is final.
    while len(sequence) < total:
        count = min(tokens, total - len(sequence))  # drafts past the last token are never needed
        bonus = len(sequence) + count < total  # the verifier's token after K kept drafts is still wanted
        one = speculation_round(decoder, sequence[-1], count, bonus, draft, sampling, rng, accept_rng)
        sequence.extend(one.drafts[:one.kept])
        if one.token is not None:
            sequence.append(one.token)
        stats.rounds += 1
        stats.drafted += count
        stats.accepted += one.kept
    return torch.tensor([sequence], device=decoder.device), stats


@torch.no_grad()
def speculative_decode(model: RecurrentLM, idx: torch.Tensor, max_new_tokens: int, *, tokens: int = 4,
                       draft_loops: Sequence[int] | int | str = 1, loop_counts: Sequence[int] | int | None = None,
                       controller_factory: Callable[[], LoopController] | None = None, temperature: float = 0.0,
                       top_k: int | None = None, top_p: float = 1.0, noise: StateNoise | None = None,
                       rng: torch.Generator | None = None, accept_rng: torch.Generator | None = None,
                       ) -> tuple[torch.Tensor, SpeculativeStats]:
    """:func:`~rdepth.model.generation.generate` of ``idx`` ``[1, T0]`` (the same arguments), speculatively:
    ``tokens`` K drafts per round at ``draft_loops`` D steps per group (N or one per group; under
    ``controller_factory`` the exit rule capped at D), verified at ``loop_counts`` (default: the model's eval
    loops) or the exit rule. ``accept_rng``: the acceptance draws (default: a generator seeded from ``rng``'s
    seed + 1, or the global one). Returns the tokens and the round statistics (see the module)."""
    if temperature < 0 or (top_k is not None and top_k < 1):
        raise RdepthError(f"generate: temperature must be >= 0 and top_k >= 1, got {temperature}, {top_k}")
    if idx.dim() != 2 or idx.shape[1] > model.config.block_size:
        raise RdepthError(f"generate: a prompt of shape {tuple(idx.shape)} does not fit the model's block size "
                          f"{model.config.block_size}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise RdepthError(f"speculative decoding drafts K >= 1 tokens per round, got {tokens!r}")
    verify = resolve_budget(model, loop_counts, controller_factory)
    draft = draft_budget(model, verify, draft_loops)
    decoder = Decoder(model, 1, loop_counts=verify.counts, controller_factory=verify.controller_factory,
                      noise=noise if noise is not None else StateNoise(0, [0]),
                      capacity=min(model.config.block_size, idx.shape[1] + max(max_new_tokens, 1)))
    if accept_rng is None and rng is not None:
        accept_rng = torch.Generator(device=rng.device).manual_seed(rng.initial_seed() + 1)
    return speculate(decoder, idx, max_new_tokens, tokens=tokens, draft=draft,
                     sampling=Sampling(temperature, top_k, top_p), rng=rng, accept_rng=accept_rng)
