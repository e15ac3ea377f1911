"""Per-token exit of HRM-Text's loops under rdepth's exit rules, decoding a token at a time over the cache.

Each token runs HRM's two loops (:mod:`rdepth.looped.hrm_text`) with one exit policy per loop
(:class:`rdepth.exits.base.ExitPolicy`, any training-free rule; None: the model's full budget):

* the **L loop** of every H step: the policy starts (``begin``) from the z_L the step enters with and
  decides after each L step; a token that stops hands on the policy's state (``handoff``) as its z_L and
  computes no more L steps in this H step. Only latent rules (no ``needs_decode``): the L state has no
  readout of its own, the H stack reads it.
* the **H loop**: decided after each H step on z_H, decoded rules reading ``lm_head(z_H)`` (the model's
  readout); a token that stops hands on its z_H, which the head reads, and runs no later H step or L loop.

**The latest-KV rule.** Every step owns a cache slot per layer (``HrmTextAdapter.kv_slots``). A token that
has stopped still gets an entry in the slots of the steps it skips, so every slot holds one entry per
position and later tokens, which may run those steps, attend to it: the entry is the keys and values of
the token's **latest computed step of the same stack** (an L slot: its last computed L step; an H slot:
its last computed H step). When other rows of the batch still compute a step, the stopped rows are
computed along (their results discarded) and their entries overwritten; when no row computes it, the
entries are appended. Rows are independent: a batch decodes as its rows decoded one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rdepth.errors import RdepthError
from rdepth.exits.base import ExitPolicy
from rdepth.looped.hrm_text import HrmCarry, HrmTextAdapter
from rdepth.looped.slot_cache import LoopedSlotCache


@dataclass
class ExitDecode:
    """What :func:`decode_with_exits` computed for tokens ``[B, T]``."""

    logits: torch.Tensor  # [B, T, V]
    low_steps: torch.Tensor  # [B, T, H_cycles] long: L steps computed in each H step (0 after the H loop stopped)
    high_steps: torch.Tensor  # [B, T] long: H steps computed
    cache: object  # the cache after the last token


def _newest(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's newest entry in cache layer ``layer``, keys and values ``[B, heads, head_dim]``: a slot
    cache's at each row's own position, a ``transformers`` cache's last."""
    if isinstance(cache, LoopedSlotCache):
        return cache.newest(layer)
    return cache.layers[layer].keys[:, :, -1], cache.layers[layer].values[:, :, -1]


def _settle(cache, slots: tuple[int, ...], sources: torch.Tensor, rows: torch.Tensor, computed: bool) -> None:
    """Give ``rows`` (bool ``[B]``) the latest-KV entry at the newest position of ``slots``: copied from the
    slots starting at ``sources[row]`` (``[B]`` long, each row's latest step's first slot). ``computed``: the
    step ran (overwrite its entry), else append one entry for every row (then ``rows`` is every row)."""
    if not computed and not bool(rows.all()):
        raise RdepthError("internal: a skipped step must settle every row")
    starts = sources.tolist()
    for depth, slot in enumerate(slots):
        newest = {start: _newest(cache, start + depth) for start in set(starts)}
        keys = torch.stack([newest[start][0][r] for r, start in enumerate(starts)])
        values = torch.stack([newest[start][1][r] for r, start in enumerate(starts)])
        if computed and isinstance(cache, LoopedSlotCache):
            cache.overwrite_newest(slot, rows, keys, values)
        elif computed:
            layer = cache.layers[slot]
            layer.keys[rows, :, -1] = keys[rows]
            layer.values[rows, :, -1] = values[rows]
        else:
            cache.update(keys.unsqueeze(2), values.unsqueeze(2), slot)


def _low_loop(adapter: HrmTextAdapter, ctx, high_step: int, carry: HrmCarry, active: torch.Tensor,
              policy: ExitPolicy | None, latest: torch.Tensor) -> tuple[HrmCarry, torch.Tensor]:
    """The L loop of H step ``high_step`` for the rows ``active`` (bool ``[B]``) of one position; returns the
    carry and each row's L steps. ``latest`` ``[B]`` long (updated in place): each row's latest computed L
    step's first slot. Rows not looping keep their z_L; the policy decides for the looping rows."""
    looping = active.clone()
    counts = torch.zeros_like(active, dtype=torch.long)
    if policy is not None:
        policy.begin(carry.low[:, -1])
    for step in range(adapter.spec("L").budget):
        slots = adapter.kv_slots("L", (high_step, step))
        if not bool(looping.any()):
            _settle(ctx.cache, slots, latest, torch.ones_like(looping), computed=False)
            continue
        updated = adapter.step(ctx, "L", (high_step, step), carry)
        _settle(ctx.cache, slots, latest, ~looping, computed=True)
        latest[looping] = slots[0]
        counts += looping.long()
        prev, new = carry.low[:, -1], updated.low[:, -1]
        handed = torch.where(looping[:, None], new, prev)
        if policy is not None:
            rows = looping.nonzero().squeeze(1)
            done, handoff, _ = policy.after_step(step + 1, rows, prev[rows], new[rows])
            handed[rows[done]] = handoff[done]
            looping[rows[done]] = False
        carry = replace(carry, low=handed.unsqueeze(1))
    return carry, counts


def decode_position(adapter: HrmTextAdapter, token: torch.Tensor, cache, low: ExitPolicy | None,
                  high: ExitPolicy | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One position for every row (``token`` ``[B, 1]``; ``cache`` a ``transformers`` cache or the engine's
    :class:`~rdepth.looped.slot_cache.LoopedSlotCache`, selected): logits ``[B, V]``, L steps ``[B, H]``, H steps ``[B]``.
    A policy's memory is begun here, per row, for this position."""
    ctx = adapter.embed(token, cache)
    carry = adapter.enter(ctx, "H", None)
    batch, high_budget = token.shape[0], adapter.spec("H").budget
    looping = torch.ones(batch, dtype=torch.bool, device=token.device)
    low_steps = torch.zeros(batch, high_budget, dtype=torch.long, device=token.device)
    high_steps = torch.zeros(batch, dtype=torch.long, device=token.device)
    latest_low = torch.zeros(batch, dtype=torch.long, device=token.device)
    latest_high = torch.zeros(batch, dtype=torch.long, device=token.device)
    if high is not None:
        high.begin(carry.high[:, -1])
    for step in range(high_budget):
        carry = adapter.enter(ctx, "L", carry)
        carry, low_steps[:, step] = _low_loop(adapter, ctx, step, carry, looping, low, latest_low)
        slots = adapter.kv_slots("H", (step,))
        if not bool(looping.any()):
            _settle(cache, slots, latest_high, torch.ones_like(looping), computed=False)
            continue
        updated = adapter.step(ctx, "H", (step,), adapter.leave(ctx, "L", carry))
        _settle(cache, slots, latest_high, ~looping, computed=True)
        latest_high[looping] = slots[0]
        high_steps += looping.long()
        prev, new = carry.high[:, -1], updated.high[:, -1]
        handed = torch.where(looping[:, None], new, prev)
        rows = looping.nonzero().squeeze(1)
        if high is not None:
            done, handoff, _ = high.after_step(step + 1, rows, prev[rows], new[rows])
            handed[rows[done]] = handoff[done]
            looping[rows[done]] = False
        carry = replace(carry, high=handed.unsqueeze(1))
    return adapter.readout(carry.high)[:, -1], low_steps, high_steps


def check_policies(adapter: HrmTextAdapter, low: ExitPolicy | None, high: ExitPolicy | None, what: str = "") -> None:
    """One-line errors (``what`` before them) for a rule on the L loop that reads the prediction, and for a rule
    whose ``k_max`` is not its loop's budget."""
    if low is not None and low.needs_decode:
        raise RdepthError(f"{what}exit rule {low.name} reads the prediction, and HRM's L state has none of its own "
                          "(the H stack reads it): choose a latent rule for the L loop")
    for policy, loop in ((low, "L"), (high, "H")):
        if policy is not None and policy.k_max != adapter.spec(loop).budget:
            raise RdepthError(f"{what}exit rule {policy.name} for loop {loop}: k_max {policy.k_max} must be the "
                              f"loop's budget {adapter.spec(loop).budget}")


def decode_with_exits(adapter: HrmTextAdapter, tokens: torch.Tensor, low: ExitPolicy | None = None,
                      high: ExitPolicy | None = None, cache=None) -> ExitDecode:
    """Teacher-forced decoding of ``tokens`` ``[B, T]`` a position at a time over the cache, with per-token
    exits of the L loop (``low``) and of the H loop (``high``); see the module docstring for the rules.

    With both policies None this is the model's full budget (its forward, position by position)."""
    if not isinstance(adapter, HrmTextAdapter):
        raise RdepthError(f"per-token exits drive HRM-Text only, not {adapter.model_type}")
    check_policies(adapter, low, high)
    cache = adapter.new_cache() if cache is None else cache
    logits, low_steps, high_steps = [], [], []
    with torch.no_grad():
        for position in range(tokens.shape[1]):
            got = decode_position(adapter, tokens[:, position:position + 1], cache, low, high)
            for store, value in zip((logits, low_steps, high_steps), got, strict=True):
                store.append(value)
    return ExitDecode(torch.stack(logits, 1), torch.stack(low_steps, 1), torch.stack(high_steps, 1), cache)


def build_policy(name: str, value: float | None, k_max: int, decode=None, options: dict | None = None) -> ExitPolicy:
    """The training-free rule ``name`` with ``value`` as its swept parameter (``tau``, or e.g. ``argmax_stable``'s
    patience; None: the rule's own default) and ``k_max`` the loop's budget; a trained rule (its gate is rdepth's)
    is a one-line error."""
    from rdepth.exits.registry import get_policy_class, make_policy

    cls = get_policy_class(name)
    if cls.trained:
        raise RdepthError(f"exit rule {name} is trained on rdepth's own model (its gate); a looped transformers model "
                          "takes the training-free rules")
    options = dict(options or {})
    if value is None or cls.sweep_parameter == "tau":
        return make_policy(name, tau=value, k_max=k_max, decode=decode, **options)
    chosen = int(value) if float(value).is_integer() else value
    return make_policy(name, k_max=k_max, decode=decode, **{cls.sweep_parameter: chosen}, **options)


def exit_quality(adapter: HrmTextAdapter, tokens: torch.Tensor, low: ExitPolicy | None = None,
                 high: ExitPolicy | None = None) -> dict[str, float]:
    """Next-token quality of exits against the full budget on ``tokens`` ``[B, T]`` (predicting positions
    1..T-1): cross-entropy (nats/token) of both, the share of positions whose argmax agrees, and the mean
    L steps per H step run and H steps per token (full budget: ``L_cycles`` and ``H_cycles``)."""
    full = decode_with_exits(adapter, tokens)
    exited = decode_with_exits(adapter, tokens, low, high)
    targets = tokens[:, 1:].reshape(-1)

    def cross_entropy(logits: torch.Tensor) -> float:
        return float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(), targets))

    ran = exited.low_steps > 0
    return {"ce_full": cross_entropy(full.logits), "ce_exit": cross_entropy(exited.logits),
            "argmax_agreement": float((full.logits.argmax(-1) == exited.logits.argmax(-1)).double().mean()),
            "mean_low_steps": float(exited.low_steps[ran].double().mean()),
            "mean_high_steps": float(exited.high_steps.double().mean()),
            "full_low_steps": float(adapter.spec("L").budget), "full_high_steps": float(adapter.spec("H").budget)}
