"""``rdepth generate`` on a looped Hugging Face folder: continuations of a prompt through the adapter's cache.

At a fixed budget (the model's own, or ``--loops`` in the adapter's loop order: HRM-Text ``H,L``, Inkling-2
``passes``) every position runs :func:`rdepth.looped.protocol.forward` over the cache. With ``--exit RULE`` (HRM-Text
only) every position, the prompt's included, runs :func:`rdepth.looped.exits.decode_with_exits`: the rule in every
loop it can read, as rdepth's ``--exit`` runs a rule in every group: a latent rule on the L loop of each H step and
on the H loop, a rule that reads the prediction on the H loop only (the L state has no readout of its own), each
capped at its loop's budget; skipped steps' cache slots follow the latest-KV rule. Sampling as rdepth's own
(:func:`rdepth.model.sampling.choose_tokens`, seeded by ``--seed``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from rdepth.errors import RdepthError
from rdepth.looped.exits import build_policy, decode_with_exits
from rdepth.looped.hrm_text import HrmTextAdapter
from rdepth.looped.load import check_flags_apply, check_token_ids, folder_tokenizer, open_looped
from rdepth.looped.protocol import LoopedAdapter, forward

log = logging.getLogger(__name__)

# The flags of rdepth generate a looped folder reads (--k-max: the caps are the loops' own budgets).
APPLICABLE = ("checkpoint", "prompt", "max_new_tokens", "temperature", "top_k", "samples", "seed", "show_special",
              "loops", "exit", "tau", "exit_options", "device", "threads")


@dataclass
class LoopedGeneration:
    """What :func:`generate_folder` made: one text per sample, and with an exit rule the steps it ran."""

    texts: list[str]
    steps: dict[str, float] | None = None  # mean L steps per L loop run, mean H steps per position


def parse_budgets(adapter: LoopedAdapter, text: str | None, command: str = "generate") -> dict[str, int] | None:
    """``--loops N`` or ``N,N,...``: one count per loop in the adapter's order (outermost first)."""
    if text is None:
        return None
    names = [spec.name for spec in adapter.loops]
    try:
        counts = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        counts = []
    if len(counts) != len(names):
        raise RdepthError(f"{command}: --loops for {adapter.model_type} is {','.join(names)} ({len(names)} count(s)), "
                          f"got {text!r}")
    return adapter.budgets(dict(zip(names, counts, strict=True)))


def exit_policies(adapter: LoopedAdapter, config, command: str = "generate") -> dict[str, Any]:
    """The rule of ``--exit`` per loop (None: the loop runs its budget)."""
    from rdepth.exits.registry import get_policy_class

    if not isinstance(adapter, HrmTextAdapter):
        raise RdepthError(f"{command}: --exit is offered for HRM-Text only; {adapter.model_type}'s passes have no "
                          "per-token exit (the later passes' cache copies hold short-convolution states)")
    options = {key: value for key, value in config.policy_options().items() if key != "gate"}
    high = build_policy(config.exit, config.tau, adapter.spec("H").budget, adapter.readout, options)
    if get_policy_class(config.exit).needs_decode:
        return {"L": None, "H": high}
    return {"L": build_policy(config.exit, config.tau, adapter.spec("L").budget, None, options), "H": high}


def generate_folder(config, given: dict[str, Any]) -> LoopedGeneration:
    """``rdepth generate`` on a looped folder (``config``: a :class:`~rdepth.run.config.GenerateConfig`)."""
    from rdepth.model.sampling import choose_tokens
    from rdepth.run.device import resolve_device

    check_flags_apply("generate", given, APPLICABLE)
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    adapter = open_looped(config.checkpoint, torch.float32)
    adapter.model.to(device)
    budgets = parse_budgets(adapter, config.loops)
    policies = exit_policies(adapter, config) if config.exit is not None else None
    tokenizer = folder_tokenizer(config.checkpoint)
    ids = tokenizer(config.prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise RdepthError("the prompt is empty after tokenisation")
    context = int(getattr(adapter.model.config, "max_position_embeddings", 0) or 0) or 10**9
    if len(ids) >= context:
        raise RdepthError(f"the prompt has {len(ids)} tokens; the model's context {context} leaves no room")
    new = min(config.max_new_tokens, context - len(ids))
    if new < config.max_new_tokens:
        log.warning("only %d new tokens fit after a %d-token prompt in the model's context %d", new, len(ids), context)
    tokens = torch.tensor([ids] * config.samples, dtype=torch.long, device=device)
    check_token_ids(tokens, adapter, "the prompt")
    sampling = torch.Generator(device=device).manual_seed(config.seed + 1)
    cache = adapter.new_cache()
    steps = {"low": 0, "low_runs": 0, "high": 0, "positions": 0}

    def logits_after(following: torch.Tensor) -> torch.Tensor:
        if policies is None:
            return forward(adapter, following, cache, budgets)[:, -1]
        run = decode_with_exits(adapter, following, policies["L"], policies["H"], cache)
        steps["low"] += int(run.low_steps.sum())
        steps["low_runs"] += int((run.low_steps > 0).sum())
        steps["high"] += int(run.high_steps.sum())
        steps["positions"] += run.high_steps.numel()
        return run.logits[:, -1]

    with torch.no_grad():
        logits = logits_after(tokens)
        for index in range(new):
            chosen = choose_tokens(logits, config.temperature, config.top_k, sampling)
            tokens = torch.cat([tokens, chosen], dim=1)
            if index + 1 < new:
                logits = logits_after(chosen)
    texts = [tokenizer.decode(row, skip_special_tokens=not config.show_special) for row in tokens.tolist()]
    if policies is None:
        return LoopedGeneration(texts)
    return LoopedGeneration(texts, {"mean_low_steps": steps["low"] / max(steps["low_runs"], 1),
                                    "mean_high_steps": steps["high"] / max(steps["positions"], 1),
                                    "full_low_steps": adapter.spec("L").budget,
                                    "full_high_steps": adapter.spec("H").budget, "positions": steps["positions"]})
