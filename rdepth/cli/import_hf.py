"""``rdepth import-hf``: a Hugging Face model folder as an rdepth run, where the architectures match."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build


def register(subparsers) -> None:
    from rdepth.interop.config import IMPORT_FORMATS, ImportConfig

    shorts = ", ".join(form.short for form in IMPORT_FORMATS.values())
    formats = "; ".join(f"{form.name} (model_type {kind}: {form.note})" for kind, form in IMPORT_FORMATS.items())
    parser = subparsers.add_parser(
        "import-hf",
        help=f"import a Hugging Face folder ({shorts}) as an rdepth run",
        description="Write an rdepth run (checkpoint + tokenizer) from a Hugging Face folder whose "
        f"architecture rdepth's model can hold exactly: {formats}. Other architectures are refused with "
        "the mismatch named. A folder holding model.safetensors and a sharded index is read from the single "
        "file, as transformers reads it.",
    )
    add_dataclass_flags(parser, ImportConfig, title="import")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.interop.config import ImportConfig
    from rdepth.interop.hf_import import import_hf

    out = import_hf(build(ImportConfig, {}, args))
    print(f"imported run: {out}")
    return 0
