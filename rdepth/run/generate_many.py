"""``rdepth generate --prompts-file``: many prompts decoded together through the continuous depth batching
engine (:class:`rdepth.engine.Engine`), each row at its own position and loop step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from rdepth.engine import Engine, Request
from rdepth.errors import RdepthError
from rdepth.run.checkpoint import load_model
from rdepth.run.config import GenerateConfig, autocast_dtype
from rdepth.run.device import resolve_device
from rdepth.run.generate_text import SPECIAL_TOKENS
from rdepth.run.heldout import run_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Continuation:
    """One prompt's (or sample's) result: ``text`` (prompt and continuation), the new ``tokens``, the mean
    loop steps per group over the new tokens, why it ended, and its error if it failed."""

    index: int
    sample: int
    text: str
    tokens: list[int]
    mean_steps: list[float]
    finish_reason: str
    error: str | None


def read_prompts(path: str) -> list[str]:
    """The non-blank lines of ``path`` (UTF-8); a one-line error for a missing, unreadable or empty file."""
    file = Path(path)
    if file.is_dir():
        raise RdepthError(f"generate: --prompts-file {path} is a directory; give a text file of prompts, one per line")
    if not file.is_file():
        raise RdepthError(f"generate: --prompts-file {path}: no such file")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise RdepthError(f"generate: --prompts-file {path}: cannot read it as UTF-8 text ({error})") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise RdepthError(f"generate: --prompts-file {path} holds no prompt (every line is blank)")
    return prompts


def generate_many(config: GenerateConfig, controllers: Callable | None = None, progress: bool = True,
                  on_result: Callable[[Continuation], None] | None = None) -> list[Continuation]:
    """Every prompt of ``config.prompts_file`` x ``config.samples``, in file order. Request i (prompt p, sample
    s) draws its initial loop states as ``StateNoise(seed, [i])`` and samples with seed ``seed + 1 + i``, so
    its text does not depend on ``--batch-size`` or on the other prompts. ``on_result(continuation)`` is called
    for result i as soon as results 0..i are all done (file order), so a caller that writes each one keeps
    what finished if the run is interrupted."""
    prompts = read_prompts(config.prompts_file)
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    model, model_config = load_model(config.checkpoint, device)
    tokenizer = run_tokenizer(config.checkpoint)
    budget = {"controller_factory": controllers(model)} if controllers is not None else (
        {"loop_counts": config.loops} if config.loops else {})
    encoded = []
    for number, text in enumerate(prompts):
        ids = tokenizer.encode(text)
        if not ids:
            raise RdepthError(f"generate: prompt {number + 1} of {config.prompts_file} is empty after tokenisation")
        encoded.append(ids)
    # each slot holds the longest prompt and its continuation, not the whole context (Ouro's is 65,536
    # positions: a slot of it would hold 96 layer-steps of keys for every one)
    capacity = min(model_config.block_size, max(map(len, encoded)) + max(config.max_new_tokens, 1))
    speculation = {} if config.speculate is None else {
        "speculate": config.speculate, "draft_loops": config.draft_loops or "1",
        "speculate_at_most": config.speculate_at_most}
    engine = Engine(model, config.batch_size, kv_layout=config.kv_layout, warm_start=config.warm_start,
                    capacity=capacity, tick=config.tick, ahead=config.ahead, **budget, **speculation)
    keys = []
    for number, ids in enumerate(encoded):
        for sample in range(config.samples):
            index = len(keys)
            engine.add_request(Request(ids, max_tokens=config.max_new_tokens, temperature=config.temperature,
                                       top_k=config.top_k, seed=config.seed + 1 + index, noise_seed=config.seed,
                                       sequence_id=index, tag=(number, sample)))
            keys.append((number, sample))
    dtype = autocast_dtype(config.autocast)
    finished, out = {}, []

    def continuation(number: int, sample: int) -> Continuation:
        done = finished.pop((number, sample))
        fed = done.steps[len(done.request.prompt) - 1:]  # the positions whose logits chose a new token
        groups = len(fed[0]) if fed else 0
        mean = [sum(position[g] for position in fed) / len(fed) for g in range(groups)] if fed else []
        text = tokenizer.decode(list(done.request.prompt) + done.tokens)
        if not config.show_special:
            for token in SPECIAL_TOKENS:
                text = text.replace(token, "\n")
        return Continuation(number, sample, text, done.tokens, mean, done.finish_reason, done.error)

    with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None), \
            tqdm(total=len(keys), desc="generate", unit="request", disable=not progress) as bar:
        for done in engine.run():
            finished[done.request.tag] = done
            bar.update(1)
            while len(out) < len(keys) and keys[len(out)] in finished:  # the next results in file order
                out.append(continuation(*keys[len(out)]))
                if on_result is not None:
                    on_result(out[-1])
    stats = engine.stats.as_dict(engine.batch)
    log.info("engine: %d requests, %d ticks, occupancy %.0f%%, mean loop steps per position %s; KV %d bytes/position",
             len(keys), stats["ticks"], 100 * stats["occupancy"], [round(s, 2) for s in stats["mean_loop_steps"]],
             engine.kv_bytes_per_token())
    if speculation:
        rounds = stats["speculation"]
        log.info("engine: loop speculation in %d ticks, %d rounds: %d of %d drafts accepted (%.0f%%)", rounds["ticks"],
                 rounds["rounds"], rounds["accepted"], rounds["drafted"], 100 * rounds["acceptance"])
    return out
