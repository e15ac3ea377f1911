"""``rdepth serve``: an OpenAI-compatible server whose every token reports the depth it used."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build, overrides


def register(subparsers) -> None:
    from rdepth.serve.config import ServeConfig

    parser = subparsers.add_parser(
        "serve",
        help="serve a checkpoint over an OpenAI-compatible HTTP API",
        description="Serve a checkpoint through the continuous depth batching engine: POST /v1/completions "
        "(streaming, logprobs, echo), /v1/chat/completions (a tokenizer with a chat template), GET /v1/models, "
        "/health, /metrics, and /tokenize for lm-eval's local-completions. Every choice reports each token's loop "
        "steps per group and why each loop stopped; a request may ask for a depth of its own (its 'rdepth' object: "
        "loops, or an exit rule at its own threshold) within --max-loops and --allow-exits. Needs the serve extra "
        "(pip install 'rdepth[serve]').",
    )
    add_dataclass_flags(parser, ServeConfig, title="serve")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.errors import RdepthError
    from rdepth.serve.config import ServeConfig

    config = build(ServeConfig, {}, args)
    given = overrides(args, ServeConfig, check=False)
    looped = _looped_folder(config.checkpoint, given)  # HRM-Text or Inkling-2 in place (rdepth.serve.looped)
    if config.replicas is not None and not looped:  # N servers under Ray Serve (docs/serve.md: scaling out)
        try:
            from rdepth.serve.ray_app import serve_replicas
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] == "ray":
                raise RdepthError("rdepth serve --replicas needs Ray Serve: pip install 'rdepth[ray]'") from None
            raise
        return serve_replicas(config)
    try:
        from rdepth.serve.server import serve
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("fastapi", "starlette", "uvicorn"):
            raise RdepthError("rdepth serve needs its extra: pip install 'rdepth[serve]'") from None
        raise
    return serve(config, given)


def _looped_folder(checkpoint: str, given: dict) -> bool:
    """Whether ``checkpoint`` is a looped transformers folder; the flags it does not read refused in one line."""
    from rdepth.looped.load import check_flags_apply, looped_source

    if not looped_source([checkpoint], "serve"):
        return False
    from rdepth.serve.looped import APPLICABLE

    check_flags_apply("serve", given, APPLICABLE)
    return True
