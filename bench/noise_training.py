"""The two initial-state noise schemes in training: a tiny chase-task model trained with
``--state-noise sequence`` and with ``counter`` on the same data, seeds and steps; prints each run's
final validation cross-entropy and the mean and sd per scheme.

    python bench/noise_training.py [--seeds 4] [--steps 200] [--json OUT]

The schemes draw different values from the same distribution, so their losses should agree within
the spread over seeds.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/noise_training.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=4, help="seeds 0 .. N-1 for each scheme")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch

    from rdepth.config import ModelConfig
    from rdepth.tasks.data import TaskDataConfig, prepare_task_data
    from rdepth.train.config import STATE_NOISES, TrainConfig
    from rdepth.train.trainer import train

    torch.set_num_threads(1)
    logging.getLogger("rdepth").setLevel(logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="noise_training_"))
    data = prepare_task_data(TaskDataConfig(
        task="chase", train_difficulties=(1, 3), train_tokens=60000, val_tokens=4000, block_size=32,
        out=root / "data", task_params='{"chase": {"nodes": 8, "queries": 4, "ordered": true}}'))
    model = ModelConfig(n_layer=2, n_head=2, d_model=32, block_size=32, vocab_size=42, groups="1", mean_loops=3.0,
                        backprop_depth=2, tokenizer="task:chase")
    result: dict[str, list[float]] = {}
    for scheme in STATE_NOISES:
        for seed in range(args.seeds):
            config = TrainConfig(data=str(data), out=str(root / f"{scheme}{seed}"), max_steps=args.steps, batch_size=16,
                                 lr=3e-3, warmup_steps=20, eval_every=args.steps, checkpoint_every=args.steps,
                                 eval_batches=8, log_every=10, threads=1, seed=seed, state_noise=scheme)
            ce = float(train(model, config).final_val["ce"])
            result.setdefault(scheme, []).append(ce)
            print(f"{scheme} seed {seed}: validation CE {ce:.4f}", flush=True)
    for scheme, values in result.items():
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"{scheme:<9} mean {statistics.mean(values):.4f}  sd {spread:.4f}  over {len(values)} seeds")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"steps": args.steps, "final_val_ce": result}, handle, indent=1)
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/noise_training.py", main))
