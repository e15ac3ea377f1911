"""``rdepth train``: train a recurrent-depth model on prepared token shards."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, overrides


def _preset_defaults() -> dict[str, str]:
    """Per model field, its value in every preset, for ``--help`` (e.g. "tiny 6, small 12, paper 12")."""
    from rdepth.config import PRESETS

    fields = {name for values in PRESETS.values() for name in values}
    return {name: ", ".join(f"{preset} {values[name]}" for preset, values in PRESETS.items() if name in values)
            for name in fields}


def register(subparsers) -> None:
    from rdepth.config import PRESETS, ModelConfig
    from rdepth.train.config import TrainConfig

    parser = subparsers.add_parser(
        "train",
        help="train a model (single process, or under torchrun: DDP, or FSDP2 with --parallel fsdp)",
        description="Train a group-recurrent language model. Start from a preset; every model "
        "and training field can be overridden. Multi-GPU: torchrun --nproc_per_node N -m rdepth train ... "
        "(add --parallel fsdp to shard the model; docs/distributed.md).",
    )
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                        help="model preset (default: tiny; with --resume, the run's own)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    add_dataclass_flags(parser, TrainConfig, title="training")
    add_dataclass_flags(parser, ModelConfig, title="model (overrides the preset; defaults per preset)",
                        defaults=_preset_defaults())
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.config import ModelConfig
    from rdepth.errors import RdepthError
    from rdepth.train.config import TrainConfig
    from rdepth.train.launch import launch, resume_preset, train_config_for

    try:
        config = train_config_for(overrides(args, TrainConfig), args.resume)
    except TypeError as exc:
        raise RdepthError(f"bad TrainConfig: {exc}") from None
    if args.resume:
        resume_preset(config.out, args.preset)
    result = launch(args.preset or "tiny", overrides(args, ModelConfig), config, resume=args.resume)
    if result.final_val is not None:
        print(f"run: {result.run_dir}")
        print(f"final validation: ce {result.final_val['ce']:.4f}, ppl {result.final_val['ppl']:.2f} "
              f"at loops {result.final_val['loop_counts']}")
        print(f"training throughput: {result.tokens_per_second:,.0f} tokens/s; wall {result.wall_seconds:.1f} s")
    return 0
