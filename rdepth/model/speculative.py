"""Self-speculative greedy decoding: draft with few loops, verify with the full budget.

A recurrent-depth model is its own draft model: the same weights at a small loop
budget. Each round drafts ``draft_tokens`` tokens one at a time at the draft
budget, then runs the pending token and the drafts through the model *once* at
the verifying budget (teacher-forced, all positions in parallel), keeps the
longest prefix of drafts that the verifying budget's greedy choice agrees with,
and adds the verifying budget's own next token. The output is token for token
the greedy output at the verifying budget (:func:`rdepth.model.generation.generate`
with ``temperature=0``), because

- a teacher-forced pass over positions ``L..L+k`` computes exactly what cached
  decoding of those positions one at a time computes (tested, with exits too);
- the initial loop states come from :class:`~rdepth.model.noise.StateNoise`,
  keyed by position, so drafting and verifying a position start from the same
  state as plain decoding does;
- rolling back is setting the cache length: entries past it are overwritten,
  step by step, before anything reads them (a position's step count is rewritten
  at every step it computes, and later steps fall back to its latest key/value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from rdepth.errors import RdepthError
from rdepth.model.control import LoopController
from rdepth.model.noise import StateNoise
from rdepth.model.recurrent import RecurrentLM


@dataclass
class SpeculativeStats:
    """``rounds``: verification passes; ``drafted``/``accepted``: draft tokens made and kept."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance}


@torch.no_grad()
def speculative_generate(
    model: RecurrentLM,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    draft_loops: Sequence[int] | int,
    loop_counts: Sequence[int] | int | None = None,
    controller_factory: Callable[[], LoopController] | None = None,
    draft_controller_factory: Callable[[], LoopController] | None = None,
    draft_tokens: int = 4,
    noise: StateNoise | None = None,
) -> tuple[torch.Tensor, SpeculativeStats]:
    """Greedy continuation of ``idx`` ``[1, T0]`` by up to ``max_new_tokens`` tokens.

    The verifying budget is ``loop_counts`` (default: the model's eval counts) or
    ``controller_factory`` (per-token exits); drafts use ``draft_loops`` (or
    ``draft_controller_factory``). ``noise`` defaults to ``StateNoise(0, [0])``;
    pass the same one to :func:`~rdepth.model.generation.generate` to compare.
    Returns the tokens ``[1, T0 + n]`` and acceptance statistics.
    """
    if idx.dim() != 2 or idx.shape[0] != 1:
        raise RdepthError(f"speculative decoding runs one sequence at a time, got a batch of shape {tuple(idx.shape)}")
    if draft_tokens < 1 or max_new_tokens < 1:
        raise RdepthError("speculative decoding needs draft_tokens >= 1 and max_new_tokens >= 1")
    model.eval()
    noise = noise if noise is not None else StateNoise(0, [0])
    verify_counts = None if controller_factory is not None else model.resolve_loop_counts(loop_counts)
    draft_counts = None if draft_controller_factory is not None else model.resolve_loop_counts(draft_loops)
    block = model.config.block_size

    def run(tokens: torch.Tensor, cache, counts, factory) -> torch.Tensor:
        controller = factory() if factory is not None else None
        return model(tokens, loop_counts=counts, controller=controller, cache=cache, generator=noise).logits

    cache = model.new_cache(1)
    stats = SpeculativeStats()
    out = idx
    if idx.shape[1] > block:
        return out, stats
    pending = run(idx, cache, verify_counts, controller_factory)[:, -1].argmax(-1, keepdim=True)  # [1, 1]
    produced = 1
    out = torch.cat([out, pending], dim=1)
    while produced < max_new_tokens and cache.length < block:
        start = cache.length  # the pending token's position
        room = min(draft_tokens, max_new_tokens - produced, block - start - 1)
        drafts = []
        step_input = pending
        for _ in range(room):
            step_input = run(step_input, cache, draft_counts, draft_controller_factory)[:, -1].argmax(-1, keepdim=True)
            drafts.append(step_input)
        cache.length = start  # verify from the pending token on, over the drafts
        candidates = torch.cat([pending, *drafts], dim=1)  # [1, room + 1]
        verified = run(candidates, cache, verify_counts, controller_factory).argmax(-1)  # [1, room + 1]
        agree = (verified[0, :room] == candidates[0, 1:]).long()
        accepted = int(agree.cumprod(0).sum())
        stats.rounds += 1
        stats.drafted += room
        stats.accepted += accepted
        cache.length = start + accepted + 1  # the pending token and the accepted drafts
        pending = verified[:, accepted : accepted + 1]
        out = torch.cat([out, candidates[:, 1 : accepted + 1], pending], dim=1)
        produced += accepted + 1
    return out[:, : idx.shape[1] + max_new_tokens], stats
