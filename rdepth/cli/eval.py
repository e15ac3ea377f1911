"""``rdepth eval``: validation cross-entropy and perplexity at chosen loop counts."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="cross-entropy / perplexity of a checkpoint at given loop counts",
        description="Evaluate a checkpoint on prepared validation shards or a text file, at one or "
        "more loop-count settings (N for every group, or N,N,... per group).",
    )
    parser.add_argument("--checkpoint", required=True, help="checkpoint folder or run folder (latest)")
    parser.add_argument("--data", required=True, help="prepared data folder (its val split) or a text file")
    parser.add_argument("--loops", action="append", default=None,
                        help="loop counts; repeat the flag to compare settings (default: the model's eval counts)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-batches", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.config import parse_loop_counts
    from rdepth.errors import RdepthError
    from rdepth.io import write_json
    from rdepth.train.checkpoint import load_model
    from rdepth.train.data_source import held_out_tokens
    from rdepth.train.evaluate import evaluate
    from rdepth.train.trainer import resolve_device

    if args.batch_size < 1 or (args.max_batches is not None and args.max_batches < 1):
        raise RdepthError("--batch-size and --max-batches must be >= 1")
    device = resolve_device(args.device)
    model, config = load_model(args.checkpoint, device)
    tokens, baseline = held_out_tokens(args.data, args.checkpoint, config)
    settings = [parse_loop_counts(spec, config.n_groups) for spec in (args.loops or [None])]
    results = []
    for counts in settings:
        result = evaluate(model, tokens, loop_counts=counts, batch_size=args.batch_size,
                          max_batches=args.max_batches, device=device, seed=args.seed,
                          block_size=min(config.block_size, len(tokens) - 1))
        results.append(result)
        print(f"loops {','.join(map(str, result['loop_counts'])):>12}: ce {result['ce']:.4f}  "
              f"ppl {result['ppl']:.2f}  ({result['tokens']} tokens)")
    if baseline:
        print(f"unigram baseline: ce {baseline['cross_entropy_nats']:.4f}  ppl {baseline['perplexity']:.2f}")
    if args.json:
        write_json(args.json, {"checkpoint": str(args.checkpoint), "results": results, "unigram_baseline": baseline})
    return 0
