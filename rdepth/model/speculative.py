"""Self-speculative greedy decoding: draft with few loops, verify with the full budget.

A recurrent-depth model is its own draft model: the same weights at a small loop
budget. Each round drafts ``draft_tokens`` tokens one at a time at the draft
budget, then runs the pending token and the drafts through the model *once* at
the verifying budget (teacher-forced, all positions in parallel), keeps the
longest prefix of drafts that the verifying budget's greedy choice agrees with,
and adds the verifying budget's own next token.

:func:`speculative_fill` does this for a *template*: a sequence in which some
positions are given and the model chooses the others (free text after a prompt is
the template whose positions after the prompt are all free; a reasoning problem
whose answers follow given queries is another). Given tokens between the free ones
are fed with them, in the drafts and in the verifying pass. The output is token
for token the greedy fill at the verifying budget (:func:`greedy_fill`;
:func:`rdepth.model.generation.generate` with ``temperature=0`` for free text),
because

- a teacher-forced pass over positions ``L..L+k`` computes exactly what cached
  decoding of those positions one at a time computes (tested, with exits too);
- the initial loop states come from :class:`~rdepth.model.noise.StateNoise`,
  keyed by position, so drafting and verifying a position start from the same
  state as plain decoding does;
- rolling back is setting the cache length (:meth:`Decoder.rollback`): entries past
  it are overwritten, step by step, before anything reads them.

Drafts, verification and the plain greedy fill all run on the one decoder
(:class:`rdepth.model.decoder.Decoder`): a draft is a one-token step at the draft
budget, a verification one lock-step pass over the drafts at the verifying budget
(one token at a time when the verifying budget has exits). Free text (greedy or
sampled, a draft capped under an exit rule, one-pass verification under exits) is
:mod:`rdepth.model.loop_speculation`; :func:`speculative_generate` runs its rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rdepth.config import parse_loop_counts
from rdepth.errors import RdepthError
from rdepth.model.budget import Budget
from rdepth.model.control import LoopController
from rdepth.model.decoder import Decoder
from rdepth.model.loop_speculation import SpeculativeStats, speculate
from rdepth.model.noise import StateNoise
from rdepth.model.recurrent import RecurrentLM


def _decoder(model: RecurrentLM, noise: StateNoise, counts, factory, draft_counts=None,
             draft_factory=None) -> Decoder:
    """A batch-1 decoder at the verifying budget whose cache keeps the larger of the two budgets."""
    budgets = [budget for budget in (counts, draft_counts) if budget is not None]
    for factory_ in (factory, draft_factory):
        if factory_ is not None:
            controller = factory_()
            budgets.append(tuple(controller.max_steps(group) for group in range(model.n_groups)))
    k_max = tuple(max(steps) for steps in zip(*budgets, strict=True)) if model.n_groups else None
    return Decoder(model, 1, loop_counts=counts, controller_factory=factory, noise=noise, keep_steps=k_max)


def _free_positions(template: torch.Tensor, free: torch.Tensor, block_size: int) -> list[int]:
    """The free positions the model can decide: each needs the logits of the position before
    it, so at most ``block_size``; position 0 has nothing before it."""
    if template.dim() != 2 or template.shape[0] != 1:
        raise RdepthError(f"speculative decoding runs one sequence at a time, got a batch of shape "
                          f"{tuple(template.shape)}")
    if free.shape != template.shape[1:] or free.dtype != torch.bool:
        raise RdepthError(f"the free-position mask must be a bool tensor of shape {tuple(template.shape[1:])}")
    if template.shape[1] and bool(free[0]):
        raise RdepthError("the first position of a template must be given: nothing comes before it")
    return [int(r) for r in torch.nonzero(free).flatten() if int(r) <= block_size]


def _eval_counts(model: RecurrentLM, loop_counts) -> tuple[int, ...]:
    """Explicit counts, else the model's eval counts (whatever mode the model is in)."""
    if loop_counts is None:
        return model.config.default_eval_loops
    return parse_loop_counts(loop_counts, model.n_groups)


@torch.no_grad()
def greedy_fill(
    model: RecurrentLM,
    template: torch.Tensor,
    free: torch.Tensor,
    *,
    loop_counts: Sequence[int] | int | None = None,
    controller_factory: Callable[[], LoopController] | None = None,
    noise: StateNoise | None = None,
) -> torch.Tensor:
    """Plain greedy decoding of a template ``[1, N]``: each position where ``free`` ``[N]`` is
    true gets the argmax of the logits before it, the given tokens up to it fed in one chunk
    through the cache. Free positions past the block size keep the template's token."""
    positions = _free_positions(template, free, model.config.block_size)
    noise = noise if noise is not None else StateNoise(0, [0])
    counts = None if controller_factory is not None else _eval_counts(model, loop_counts)
    decoder = _decoder(model, noise, counts, controller_factory)
    out = template.to(decoder.device).clone()
    for position in positions:
        out[0, position] = decoder.extend(out[:, decoder.length:position])[0, -1].argmax()
    return out


@torch.no_grad()
def speculative_fill(
    model: RecurrentLM,
    template: torch.Tensor,
    free: torch.Tensor,
    *,
    draft_loops: Sequence[int] | int | None = None,
    loop_counts: Sequence[int] | int | None = None,
    controller_factory: Callable[[], LoopController] | None = None,
    draft_controller_factory: Callable[[], LoopController] | None = None,
    draft_tokens: int = 4,
    noise: StateNoise | None = None,
) -> tuple[torch.Tensor, SpeculativeStats]:
    """:func:`greedy_fill` at the verifying budget, token for token, drafting ``draft_tokens``
    free positions per round at the draft budget and verifying them in one pass.

    The verifying budget is ``loop_counts`` (default: the model's eval counts) or
    ``controller_factory`` (per-token exits); drafts use ``draft_loops`` (or
    ``draft_controller_factory``). ``noise`` defaults to ``StateNoise(0, [0])``.
    Returns the filled ``[1, N]`` tokens and the statistics (free positions drafted
    and accepted).
    """
    if draft_tokens < 1:
        raise RdepthError("speculative decoding needs draft_tokens >= 1")
    if draft_loops is None and draft_controller_factory is None:
        raise RdepthError("speculative decoding needs a draft budget (draft_loops or a draft controller)")
    positions = _free_positions(template, free, model.config.block_size)
    noise = noise if noise is not None else StateNoise(0, [0])
    verify_counts = None if controller_factory is not None else _eval_counts(model, loop_counts)
    draft_counts = None if draft_controller_factory is not None else _eval_counts(model, draft_loops)
    decoder = _decoder(model, noise, verify_counts, controller_factory, draft_counts, draft_controller_factory)
    out = template.to(decoder.device).clone()
    stats = SpeculativeStats()
    if not positions:
        return out, stats
    first = positions[0]
    out[0, first] = decoder.extend(out[:, :first])[0, -1].argmax()
    # Invariant: the decoder holds positions < decoder.length at the verifying budget, and the token at
    # decoder.length (the last decided free position, or a given one) is final.
    decided = 1  # positions[:decided] are final
    while decided < len(positions):
        start = decoder.length
        drafted: list[int] = []
        while len(drafted) < draft_tokens and decided + len(drafted) < len(positions):
            position = positions[decided + len(drafted)]
            out[0, position] = decoder.extend(out[:, decoder.length:position], loop_counts=draft_counts,
                                              controller_factory=draft_controller_factory)[0, -1].argmax()
            drafted.append(position)
        following = decided + len(drafted)  # the free position after the drafts, if any
        end = positions[following] if following < len(positions) else drafted[-1]
        decoder.rollback(start)  # verify from the last final token on, over the drafts
        verified = decoder.extend(out[:, start:end]).argmax(-1)[0]
        accepted = 0
        for position in drafted:
            choice = verified[position - 1 - start]
            if choice != out[0, position]:
                out[0, position] = choice  # the verifying budget's own token: final
                decoder.rollback(position)
                break
            accepted += 1
        else:
            if following < len(positions):  # every draft kept: the next free position comes free
                out[0, end] = verified[end - 1 - start]
            decoder.rollback(end)
        stats.rounds += 1
        stats.drafted += len(drafted)
        stats.accepted += accepted
        decided += accepted + 1
    return out, stats


@torch.no_grad()
def speculative_generate(model: RecurrentLM, idx: torch.Tensor, max_new_tokens: int, *,
                         draft_loops: Sequence[int] | int | None = None, loop_counts: Sequence[int] | int | None = None,
                         controller_factory: Callable[[], LoopController] | None = None,
                         draft_controller_factory: Callable[[], LoopController] | None = None, draft_tokens: int = 4,
                         noise: StateNoise | None = None) -> tuple[torch.Tensor, SpeculativeStats]:
    """Greedy continuation of ``idx`` ``[1, T0]`` by up to ``max_new_tokens`` tokens (fewer at the block
    size) with any draft budget, the verifier's included (``draft_loops`` counts or a
    ``draft_controller_factory``; the budgets as :func:`speculative_fill`'s): the rounds of
    :func:`rdepth.model.loop_speculation.speculate` (free text; :func:`rdepth.model.loop_speculation.
    speculative_decode` checks the draft against the verifier and samples too). Returns the tokens
    ``[1, T0 + n]`` and acceptance statistics; the same tokens as :func:`~rdepth.model.generation.generate`
    at ``temperature=0`` with the same ``noise``."""
    if idx.dim() != 2 or idx.shape[0] != 1:
        raise RdepthError(f"speculative decoding runs one sequence at a time, got a batch of shape {tuple(idx.shape)}")
    if max_new_tokens < 1:
        raise RdepthError("speculative decoding needs max_new_tokens >= 1")
    if draft_loops is None and draft_controller_factory is None:
        raise RdepthError("speculative decoding needs a draft budget (draft_loops or a draft controller)")
    if idx.shape[1] > model.config.block_size:
        return idx, SpeculativeStats()
    noise = noise if noise is not None else StateNoise(0, [0])
    verify_counts = None if controller_factory is not None else _eval_counts(model, loop_counts)
    draft_counts = None if draft_controller_factory is not None else _eval_counts(model, draft_loops)
    decoder = _decoder(model, noise, verify_counts, controller_factory, draft_counts, draft_controller_factory)
    draft = Budget(counts=draft_counts, controller_factory=draft_controller_factory)
    return speculate(decoder, idx, max_new_tokens, tokens=draft_tokens, draft=draft)
