"""``rdepth import-hf``: a Hugging Face model folder as an rdepth run, where the architectures match."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build


def register(subparsers) -> None:
    from rdepth.interop.config import ImportConfig

    parser = subparsers.add_parser(
        "import-hf",
        help="import a Hugging Face folder (rdepth export, GPT-2, Huginn-0125/raven) as an rdepth run",
        description="Write an rdepth run (checkpoint + tokenizer) from a Hugging Face folder whose "
        "architecture rdepth's model can hold exactly: a folder written by rdepth export; a GPT-2 "
        "folder (a plain model of gpt2 blocks; loop its layers with rdepth retrofit); a Huginn-0125 (raven) "
        "folder (model_type huginn_raven, e.g. tomg-group-umd/huginn-0125). Other "
        "architectures are refused with the mismatch named.",
    )
    add_dataclass_flags(parser, ImportConfig, title="import")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.interop.config import ImportConfig
    from rdepth.interop.hf_import import import_hf

    out = import_hf(build(ImportConfig, {}, args))
    print(f"imported run: {out}")
    return 0
