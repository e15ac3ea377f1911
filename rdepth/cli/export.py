"""``rdepth export``: a checkpoint as a Hugging Face folder (``trust_remote_code=True``)."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build


def register(subparsers) -> None:
    from rdepth.interop.config import ExportConfig

    parser = subparsers.add_parser(
        "export",
        help="export a checkpoint as a Hugging Face model folder",
        description="Write a folder that transformers' AutoModelForCausalLM.from_pretrained(DIR, "
        "trust_remote_code=True) and AutoTokenizer.from_pretrained(DIR) load: weights, config, tokenizer "
        "files and modeling code generated from rdepth's own source. Loop counts per group and the "
        "initial-state seed are settable in config.json or per call.",
    )
    add_dataclass_flags(parser, ExportConfig, title="export")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.interop.config import ExportConfig
    from rdepth.interop.export import export_run

    out = export_run(build(ExportConfig, {}, args))
    print(f"exported to {out}")
    return 0
