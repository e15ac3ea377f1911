"""``rdepth sweep``: exit policies over a threshold grid; latency, perplexity, loop steps."""

from __future__ import annotations

import argparse


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one number, got {text!r}")
    return values


def _grid(text: str) -> tuple[str, tuple[float, ...]]:
    name, sep, values = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected POLICY=V1,V2,..., got {text!r}")
    return name.strip(), _floats(values)


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,N,... (integers), got {text!r}") from None


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="latency / quality of every exit policy over a threshold grid (paper Fig. 4)",
        description="Evaluate held-out text with per-token early exits for each policy over a tau grid "
        "(default 1e-5..1e-2, log scale); record loop steps per group, exit-step histograms, ms/token "
        "(batch 1 and batched), perplexity and cross-entropy, with the fixed budget at the same mean "
        "steps as a baseline. Writes sweep.json, sweep.csv, figures/ and an index.html section into --out.",
    )
    parser.add_argument("--checkpoint", required=True, help="checkpoint folder or run folder (latest)")
    parser.add_argument("--data", required=True, help="prepared data folder (its val split) or a text file")
    parser.add_argument("--out", required=True, help="output folder (created; files replaced atomically)")
    parser.add_argument("--policies", type=_names, default=None,
                        help="comma-separated policy names (default: every policy except fixed)")
    parser.add_argument("--taus", type=_floats, default=None, help="tau grid, e.g. 1e-5,1e-4,1e-3,1e-2")
    parser.add_argument("--grid", type=_grid, action="append", default=[],
                        help="per-policy grid, e.g. kl=1e-6,1e-5 or argmax_stable=1,2,4 (repeatable)")
    parser.add_argument("--k-max", type=_ints, default=None,
                        help="step cap N or N,N,... per group (default: twice the model's eval loops)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=None, help="window length (default: the model's)")
    parser.add_argument("--max-batches", type=int, default=4, help="evaluation batches per point")
    parser.add_argument("--timing-batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--generate-tokens", type=int, default=0,
                        help="also time greedy cached generation of N tokens, batch 1 (default 0: skip)")
    parser.add_argument("--generate-prompt", type=int, default=16, help="prompt length for --generate-tokens")
    parser.add_argument("--no-timing", action="store_true", help="skip latency measurements")
    parser.add_argument("--no-ladder", action="store_true", help="skip the ladder of fixed budgets 1..k_max")
    parser.add_argument("--autocast", default="none", help="none, bf16 or fp16 (CUDA)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from rdepth.exits.sweep import (
        DEFAULT_TAUS, SweepConfig, default_policies, matched_quality, run_sweep, write_sweep,
    )
    from rdepth.train.checkpoint import load_model
    from rdepth.train.data_source import held_out_tokens
    from rdepth.train.trainer import resolve_device

    log = logging.getLogger("rdepth.sweep")
    config = SweepConfig(
        policies=args.policies or default_policies(),
        taus=args.taus or DEFAULT_TAUS,
        grids=dict(args.grid),
        k_max=args.k_max,
        batch_size=args.batch_size,
        block_size=args.block_size,
        max_batches=args.max_batches,
        timing=not args.no_timing,
        timing_batch_size=args.timing_batch_size,
        warmup=args.warmup,
        repeats=args.repeats,
        generate_tokens=args.generate_tokens,
        generate_prompt=args.generate_prompt,
        fixed_ladder=not args.no_ladder,
        autocast=args.autocast,
        seed=args.seed,
    )
    device = resolve_device(args.device)
    model, model_config = load_model(args.checkpoint, device)
    tokens, _ = held_out_tokens(args.data, args.checkpoint, model_config)
    if config.block_size is None and len(tokens) - 1 < model_config.block_size:
        config.block_size = len(tokens) - 1
    result = run_sweep(model, tokens, config, device=device)
    result["checkpoint"] = str(args.checkpoint)
    result["data"] = str(args.data)
    paths = write_sweep(result, args.out)
    for row in matched_quality(result):
        if row["value"] is None:
            print(f"{row['policy']:>20}: no point within 1% of the full budget's perplexity")
            continue
        timing = f", {row['speedup_vs_full_b1']:.2f}x the full budget's speed" if "speedup_vs_full_b1" in row else ""
        print(f"{row['policy']:>20}: value {row['value']:g}, ppl {row['ppl']:.4f} "
              f"({100 * row['ppl_vs_full']:+.2f}%), steps saved {100 * row['steps_saved']:.1f}%{timing}")
    log.info("wrote %s", ", ".join(str(p) for p in paths.values()))
    return 0
