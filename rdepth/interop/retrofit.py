"""Retrofitting recurrence: loop chosen layers of a plain model, starting exactly where it was.

McLeish et al. (2025, "Teaching pretrained language models to think deeper with
retrofitted recurrence") turn a pretrained transformer into a recurrent-depth one
and train it further. Here the plain model is an rdepth model with no groups
(``--groups ''``): its layers and embeddings are kept, the chosen layers become
recurrence groups, and each group's adapter ``Linear(2d -> d)`` is initialised to
``[0 | I]``, so that

    adapter_g(concat(s, e)) = 0 * s + I * e = e     for any initial state s,

and every loop step is ``layers_g(e)``: the new model *is* the original (tested
bit for bit, with random initial states), with one loop per group and, at this
start, with any number, since no step reads the state yet. Training
(``rdepth train --init-from NEW_RUN``) moves the state half of the adapters off
zero, and the loop starts to matter; gradients reach it from the first step.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rdepth.errors import RdepthError
from rdepth.interop.config import RetrofitConfig
from rdepth.interop.output import staged_folder
from rdepth.io import write_json
from rdepth.model import RecurrentLM
from rdepth.run.checkpoint import checkpoint_step, is_rdepth_run, load_model, resolve_checkpoint, save_checkpoint
from rdepth.run.heldout import run_tokenizer

log = logging.getLogger(__name__)


def identity_adapter(d_model: int) -> torch.Tensor:
    """The ``[d, 2d]`` weight ``[0 | I]``: passes the input ``e`` through and ignores the state."""
    return torch.cat([torch.zeros(d_model, d_model), torch.eye(d_model)], dim=1)


def retrofit_model(model: RecurrentLM, groups: str, **changes) -> RecurrentLM:
    """A recurrent copy of the plain ``model`` whose ``groups`` (e.g. ``"2-3"``) loop.

    ``changes``: other model fields of the new config (``mean_loops``,
    ``backprop_depth``, ``init_state_scale``). Every weight is copied; the adapters
    are ``[0 | I]``, so one loop per group reproduces ``model`` exactly.
    """
    config = model.config
    if config.group_specs:
        raise RdepthError(f"retrofit starts from a plain model, but this one already loops (groups "
                          f"{config.groups!r}); train one with --groups ''")
    new_config = config.replace(groups=groups, eval_loops=None, **changes)
    if not new_config.group_specs:
        raise RdepthError("retrofit: --groups must name the layers to loop, e.g. '2-3'")
    retrofitted = RecurrentLM(new_config)
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    adapter = identity_adapter(config.d_model).to(next(model.parameters()).dtype)
    for group in range(new_config.n_groups):
        weights[f"adapters.{group}.weight"] = adapter.clone()
    retrofitted.load_state_dict(weights)  # strict: every weight accounted for
    return retrofitted.to(next(model.parameters()).device).train(model.training)


def retrofit_run(config: RetrofitConfig) -> Path:
    """``rdepth retrofit``: a new run folder holding the retrofitted model at step 0 and the
    source run's tokenizer; ``retrofit.json`` records where it came from."""
    source = Path(config.checkpoint)
    if not source.exists():
        raise RdepthError(f"checkpoint not found: {source}")
    if not (is_rdepth_run(source) or source.name == "checkpoints" and is_rdepth_run(source.parent)):
        raise RdepthError(f"{source} is not an rdepth run or checkpoint folder")
    checkpoint = resolve_checkpoint(source)
    model, model_config = load_model(checkpoint)
    changes = {"mean_loops": config.mean_loops}
    if config.backprop_depth is not None:
        changes["backprop_depth"] = config.backprop_depth
    if config.init_state_scale is not None:
        changes["init_state_scale"] = config.init_state_scale
    retrofitted = retrofit_model(model, config.groups, **changes)
    tokenizer = run_tokenizer(checkpoint)
    with staged_folder(config.out, "retrofit") as folder:
        save_checkpoint(folder, 0, retrofitted, retrofitted.config,
                        state={"retrofit_from": str(checkpoint.resolve()), "source_step": checkpoint_step(checkpoint)})
        tokenizer.save(folder / "tokenizer")
        write_json(folder / "retrofit.json", {
            "source": str(checkpoint.resolve()),
            "source_step": checkpoint_step(checkpoint),
            "groups": retrofitted.config.groups,
            "adapters": "[0 | I]: one loop per group reproduces the source model",
            "model": retrofitted.config.to_dict(),
        })
    log.info("retrofitted %s with groups %s into %s", checkpoint, config.groups, config.out)
    return Path(config.out)
