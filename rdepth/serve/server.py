"""``rdepth serve``: a checkpoint, its tokenizer and the engine behind the HTTP API (:mod:`rdepth.serve.api`)."""

from __future__ import annotations

import logging
from pathlib import Path

from rdepth.errors import RdepthError
from rdepth.serve.api import ServedModel, build_app
from rdepth.serve.chat import ChatRenderer
from rdepth.serve.config import ServeConfig
from rdepth.serve.depth import build_engine, check_allowed
from rdepth.serve.listen import bind_sockets
from rdepth.serve.runner import EngineRunner

log = logging.getLogger(__name__)


def served_model(config: ServeConfig, given: dict | None = None) -> ServedModel:
    """Load the checkpoint, build the engine under the budget or exit rule (and the depths a request may ask
    for: :mod:`rdepth.serve.depth`), start its thread. A looped ``transformers`` folder (HRM-Text, Inkling-2) is
    served in place through its adapter (:mod:`rdepth.serve.looped`; ``given``: the flags typed, which it checks
    apply)."""
    import torch

    from rdepth.looped.load import looped_source

    if looped_source([config.checkpoint], "serve"):
        from rdepth.serve.looped import served_folder

        return served_folder(config, given or {})

    from rdepth.run.chat_template import run_chat_template
    from rdepth.run.checkpoint import load_model
    from rdepth.run.device import resolve_device
    from rdepth.run.heldout import run_tokenizer

    options, allowed = check_policies(config)
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    model, model_config = load_model(config.checkpoint, device)
    tokenizer = run_tokenizer(config.checkpoint)
    template = run_chat_template(config.checkpoint)
    chat = ChatRenderer(template) if template is not None else None
    context = config.context or model_config.block_size
    if context > model_config.block_size:
        raise RdepthError(f"serve: --context {context} exceeds the model's block size {model_config.block_size}")
    engine, depths = build_engine(config, model, context, allowed, options)
    name = config.name or _default_name(config.checkpoint)
    return ServedModel(name, tokenizer, EngineRunner(engine).start(), context, depths.policy, config.max_tokens,
                       config.max_n, config.seed, config.max_choices, config.max_body_bytes, config.max_logprobs, chat,
                       depths)


def check_policies(config: ServeConfig) -> tuple[dict, list]:
    """The exit policy's options and the rules a request may ask for (``--exit``, ``--allow-exits``), checked
    before any checkpoint loads: a bad name, tau or option, or a gate named for another model, is one line."""
    from rdepth.exitrun.gate_file import check_gate_option
    from rdepth.exits.controller import controller_factory

    options = config.policy_options() if config.exit else {}
    check_gate_option(config.exit, options, config.checkpoint)  # a gate named for another model
    if config.exit:
        controller_factory(config.exit, config.tau, config.k_max or (1,), options=options)
    return options, check_allowed(config, options)  # --allow-exits: its names and thresholds too


def _default_name(checkpoint: str) -> str:
    """The run folder's name, with its parent's where the folder is a run's ``train`` or a ``step_*`` checkpoint
    (``runs/demo/train`` -> ``demo/train``)."""
    path = Path(checkpoint).resolve()
    if path.name == "train" or path.name.startswith("step_") or path.name == "checkpoints":
        return f"{path.parent.name}/{path.name}"
    return path.name


def serve(config: ServeConfig, given: dict | None = None) -> int:
    """Serve until interrupted. The port is taken first (in use, or a host that does not resolve: one line,
    before the checkpoint loads), then uvicorn serves on it."""
    try:
        import uvicorn
    except ModuleNotFoundError:
        raise RdepthError("rdepth serve needs its extra: pip install 'rdepth[serve]'") from None
    sockets = bind_sockets(config.host, config.port)
    try:
        served = served_model(config, given)
        log.info("serving %s (%s; a request may ask for %s) on http://%s:%d with %d slots", served.name,
                 served.policy, served.depths.card(), config.host, config.port, config.batch_size)
        try:
            uvicorn.Server(uvicorn.Config(build_app(served), log_level="info")).run(sockets=sockets)
        finally:
            served.runner.stop()
    finally:
        for sock in sockets:
            sock.close()
    return 0
