"""Does a model leave the unigram plateau on this data? Train one size briefly and compare.

    python scripts/unigram_plateau.py --data DATA [--data OTHER ...] [--steps 200] [--out /tmp/plateau]
        [--size tiny|mini|...] [--lr 3e-3] [--warmup 33] [--batch-size 16] [--max-steps 500]
        [--groups SPEC] [--set FIELD=VALUE]

For each prepared text folder (the model takes the folder's tokenizer and vocabulary; --out must
not hold earlier runs), trains a size of ``rdepth reproduce`` (default ``tiny``) with the text
demo's settings unless told otherwise (batch 16, lr 3e-3, warmup 33, weight decay 0.1, a
500-step schedule) for --steps steps, one thread, and prints the training loss every 20 steps
beside the data's unigram entropy (from the folder's unigram.npy).

What it showed (docs/results.md, "The unigram plateau"): on the medium corpus the looped `tiny`
model stays at the unigram loss at lr 3e-3 after a 33-step warm-up and leaves it after a
150-step one (or at lr 1e-3), while on the Wikipedia leads the short warm-up is enough.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", action="append", required=True, help="prepared text folder (repeatable)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (the text demo's: 3e-3)")
    parser.add_argument("--warmup", type=int, default=33, help="linear warm-up steps (the text demo's: 33)")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per step (the text demo's: 16)")
    parser.add_argument("--max-steps", type=int, default=500, help="length of the cosine schedule (demo: 500)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a model field of the tiny preset (repeatable), e.g. init_state_scale=0.1")
    parser.add_argument("--size", default="tiny", help="a size of rdepth reproduce (rdepth.reproduce.plan.SIZES): "
                        "tiny (default), mini, small, paper, toy")
    parser.add_argument("--groups", default=None, help="recurrence groups (default: the tiny preset's; '' for none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, batches and loop counts")
    parser.add_argument("--out", default="/tmp/plateau")
    args = parser.parse_args(argv)

    import numpy as np

    from rdepth.config import get_preset
    from rdepth.data.shards import TokenShards
    from rdepth.reproduce.plan import SIZES
    from rdepth.train.config import TrainConfig
    from rdepth.train.trainer import train

    for index, data in enumerate(args.data):
        shards = TokenShards.open(data)
        log_p = np.load(Path(data) / "unigram.npy")
        entropy = float(-(np.exp(log_p) * log_p).sum())
        fields = {} if args.groups is None else {"groups": args.groups}
        for item in args.set:
            name, _, value = item.partition("=")
            fields[name] = json.loads(value)
        size = SIZES[args.size]
        model = get_preset(size.preset, **{**size.overrides, **fields}, vocab_size=shards.tokenizer.vocab_size,
                           tokenizer=shards.tokenizer.name)
        out = Path(args.out) / f"run{index}"
        config = TrainConfig(data=data, out=str(out), max_steps=args.max_steps, stop_at=args.steps,
                             batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup, weight_decay=0.1, eval_every=10**6, checkpoint_every=10**6,
                             log_every=20, seed=args.seed, threads=1, eval_batches=1)
        train(model, config)
        losses = [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        print(f"{data}: unigram entropy {entropy:.3f} nats; loss " +
              ", ".join(f"{step}: {loss:.2f}" for step, loss in losses))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
