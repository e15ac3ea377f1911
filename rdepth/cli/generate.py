"""``rdepth generate``: sample text from a checkpoint with a KV cache."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build


def register(subparsers) -> None:
    from rdepth.run.config import GenerateConfig

    parser = subparsers.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Generate text with a key/value cache (exact under recurrence); loop counts per group selectable.",
    )
    add_dataclass_flags(parser, GenerateConfig, title="generation")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.run.config import GenerateConfig
    from rdepth.run.generate_text import generate_text

    config = build(GenerateConfig, {}, args)

    def profile_controllers(model):
        from rdepth.exits.profile import load_profile, profile_controller_factory

        profile = load_profile(config.exit_profile, model.n_groups)
        return profile_controller_factory(profile, lambda: model.readout)

    for text in generate_text(config, profile_controllers if config.exit_profile is not None else None):
        print(text)
        print("---")
    return 0
