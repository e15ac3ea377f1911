"""``rdepth generate`` as one call: continuations of a prompt from a checkpoint."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from rdepth.config import parse_loop_counts
from rdepth.errors import RdepthError
from rdepth.model.generation import generate
from rdepth.model.noise import StateNoise
from rdepth.run.checkpoint import load_model
from rdepth.run.config import GenerateConfig, autocast_dtype
from rdepth.run.device import resolve_device
from rdepth.run.heldout import run_tokenizer

SPECIAL_TOKENS = ("<|endoftext|>",)
log = logging.getLogger(__name__)


def generate_text(config: GenerateConfig, controllers: Callable | None = None) -> list[str]:
    """One string per sample: the prompt and its continuation (special tokens hidden unless
    ``config.show_special``). ``controllers``: ``model -> factory of loop controllers`` for
    per-token exits (the CLI builds it from ``--exit-profile`` or ``--exit``). Every forward pass
    runs under ``config.autocast``."""
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    model, model_config = load_model(config.checkpoint, device)
    tokenizer = run_tokenizer(config.checkpoint)
    counts = parse_loop_counts(config.loops, model_config.n_groups) if config.loops else None
    ids = tokenizer.encode(config.prompt)
    if not ids:
        raise RdepthError("the prompt is empty after tokenisation")
    if len(ids) >= model_config.block_size:
        raise RdepthError(
            f"the prompt has {len(ids)} tokens; the model's block size {model_config.block_size} leaves no room"
        )
    room = model_config.block_size + 1 - len(ids)  # generation stops when the context is full
    if config.max_new_tokens > room:
        log.warning("only %d new tokens fit after a %d-token prompt in the model's block size %d "
                    "(asked for %d)", room, len(ids), model_config.block_size, config.max_new_tokens)
    prompt = torch.tensor([ids] * config.samples, dtype=torch.long, device=device)
    noise = StateNoise.consecutive(config.seed, 0, config.samples)  # as teacher-forced evaluation
    sampling = torch.Generator(device=device).manual_seed(config.seed + 1)
    dtype = autocast_dtype(config.autocast)
    with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = _generate(config, model, model_config, prompt, counts, noise, sampling, controllers)
    texts = [tokenizer.decode(row) for row in out.tolist()]
    if not config.show_special:
        for token in SPECIAL_TOKENS:
            texts = [text.replace(token, "\n") for text in texts]
    return texts


def _generate(config: GenerateConfig, model, model_config, prompt, counts, noise, sampling,
              controllers: Callable | None) -> torch.Tensor:
    """The token ids ``[samples, P + new]``: loop-speculative (one sample at a time), or plain cached generation."""
    factory = None if controllers is None else controllers(model)
    if config.speculate is not None:
        from rdepth.model.loop_speculation import speculative_decode

        draft = parse_loop_counts(config.draft_loops or "1", model_config.n_groups)
        rows = []
        for sample in range(config.samples):
            row, stats = speculative_decode(
                model, prompt[sample : sample + 1], config.max_new_tokens, tokens=config.speculate, draft_loops=draft,
                loop_counts=counts, controller_factory=factory, temperature=config.temperature, top_k=config.top_k,
                noise=StateNoise(config.seed, [sample]), rng=sampling)
            log.info("speculative decoding: %d of %d drafts accepted (%.0f%%), %.2f per verification pass of %d",
                     stats.accepted, stats.drafted, 100 * stats.acceptance, stats.mean_accepted, stats.rounds)
            rows.append(row)
        return torch.cat(rows)
    return generate(model, prompt, config.max_new_tokens, temperature=config.temperature, top_k=config.top_k,
                    loop_counts=counts, noise=noise, rng=sampling, warm_start=config.warm_start,
                    controller_factory=factory)
