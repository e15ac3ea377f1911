"""``rdepth train``: train a recurrent-depth model on prepared token shards."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build, overrides


def register(subparsers) -> None:
    from rdepth.config import PRESETS, ModelConfig
    from rdepth.train.config import TrainConfig

    parser = subparsers.add_parser(
        "train",
        help="train a model (single process, or under torchrun for DDP)",
        description="Train a group-recurrent language model. Start from a preset; every model "
        "and training field can be overridden. Multi-GPU: torchrun --nproc_per_node N -m rdepth train ...",
    )
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model preset (default tiny)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    add_dataclass_flags(parser, TrainConfig, title="training")
    add_dataclass_flags(
        parser, ModelConfig, skip=("vocab_size", "tokenizer"), title="model (overrides the preset)",
        help_overrides={"groups": "recurrence groups, e.g. '4|5-6|7' (0-based layers, a-b inclusive)",
                        "eval_loops": "evaluation loop counts: N or N,N,... per group"},
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.config import ModelConfig, get_preset
    from rdepth.train import checkpoint as ckpt
    from rdepth.train.config import TrainConfig
    from rdepth.train.trainer import train

    train_config = build(TrainConfig, {}, args)
    model_overrides = overrides(args, ModelConfig)
    if args.resume and ckpt.list_checkpoints(train_config.out):
        # The run's own config is the base; flags may only repeat it.
        base = ckpt.load_model_config(ckpt.resolve_checkpoint(train_config.out)).to_dict()
        model_config = ModelConfig.from_dict({**base, **model_overrides})
    else:
        model_config = get_preset(args.preset, **model_overrides)
    result = train(model_config, train_config, resume=args.resume)
    if result.final_val is not None:
        print(f"run: {result.run_dir}")
        print(f"final validation: ce {result.final_val['ce']:.4f}, ppl {result.final_val['ppl']:.2f} "
              f"at loops {result.final_val['loop_counts']}")
        print(f"training throughput: {result.tokens_per_second:,.0f} tokens/s; wall {result.wall_seconds:.1f} s")
    return 0
