"""``rdepth generate``: sample text from a checkpoint with a KV cache."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Generate text with a key/value cache (exact under recurrence); loop counts per group selectable.",
    )
    parser.add_argument("--checkpoint", required=True, help="checkpoint folder or run folder (latest)")
    parser.add_argument("--prompt", default="The", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=60)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--loops", default=None, help="loop counts: N or N,N,... per group")
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from rdepth.config import parse_loop_counts
    from rdepth.errors import RdepthError
    from rdepth.model.generation import generate
    from rdepth.train.checkpoint import load_model
    from rdepth.train.data_source import run_tokenizer
    from rdepth.train.trainer import resolve_device

    if args.max_new_tokens < 1 or args.samples < 1 or (args.top_k is not None and args.top_k < 1):
        raise RdepthError("--max-new-tokens, --samples and --top-k must be >= 1")
    device = resolve_device(args.device)
    model, config = load_model(args.checkpoint, device)
    tokenizer = run_tokenizer(args.checkpoint)
    counts = parse_loop_counts(args.loops, config.n_groups) if args.loops else None
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise RdepthError("the prompt is empty after tokenisation")
    ids = ids[-(config.block_size - 1):]
    prompt = torch.tensor([ids] * args.samples, dtype=torch.long, device=device)
    noise = torch.Generator(device=device).manual_seed(args.seed)
    sampling = torch.Generator(device=device).manual_seed(args.seed + 1)
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   loop_counts=counts, generator=noise, sample_generator=sampling)
    for row in out.tolist():
        print(tokenizer.decode(row))
        print("---")
    return 0
