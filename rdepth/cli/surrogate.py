"""``rdepth surrogate``: fit a block-recurrent (Raptor) surrogate of a pretrained transformer.

Every flag maps to a field of :class:`rdepth.surrogate.run.SurrogateRunConfig` (fitting flags
to its nested :class:`rdepth.surrogate.fit.FitConfig`); values are validated there.
"""

from __future__ import annotations

import argparse
import os

RUN_DEFAULTS = {"teacher": "minilm-l6", "k": 2, "out": "runs/surrogate", "corpus": "wiki", "n_fit": 1024,
                "n_eval": 256, "max_length": 64, "batch_size": 32, "similarity": "pooled_cosine",
                "phase_method": "dp", "init": "first", "threads": 0, "seed": 0}
FIT_DEFAULTS = {"steps_block": 100, "steps_joint": 200, "lr": 3e-4, "weight_decay": 0.0, "grad_clip": 1.0,
                "force_start": 1.0, "force_end": 0.0, "anneal_fraction": 0.6, "first_token_weight": 1.0,
                "log_every": 10}
HELP = {
    "teacher": "packaged teacher (minilm-l6, minilm-l3) or a Hugging Face checkpoint folder (BERT or GPT-2)",
    "k": "number of distinct recurrent blocks (phases)",
    "out": "run folder (report, numbers, surrogate checkpoint)",
    "corpus": "text for fitting and evaluation: a corpus name (wiki) or a .txt/.jsonl file or folder",
    "n_fit": "sentences to fit on", "n_eval": "held-out sentences to evaluate on",
    "max_length": "tokens per sentence at most", "batch_size": "sentences per batch",
    "similarity": "layer similarity used to choose phases: pooled_cosine, token_cosine or cka",
    "phase_method": "phase finder: dp (exact dynamic programme) or maxcut (recursive max-cut)",
    "init": "block initialisation: first or middle layer of its phase, or random",
    "threads": "torch CPU threads (0 = default)", "seed": "random seed",
    "steps_block": "stage 1 steps per block", "steps_joint": "stage 2 (joint) steps", "lr": "learning rate",
    "weight_decay": "AdamW weight decay", "grad_clip": "gradient norm clip",
    "force_start": "teacher-forcing probability at the start of each stage",
    "force_end": "teacher-forcing probability after annealing (0 = free rollout)",
    "anneal_fraction": "fraction of each stage over which forcing anneals",
    "first_token_weight": "loss weight of the first ([CLS]) token relative to the others",
    "log_every": "steps between metrics.jsonl records",
}


def register(subparsers) -> None:
    parser = subparsers.add_parser("surrogate", help="fit a block-recurrent (Raptor) surrogate of a transformer",
                                   description="Fit a block-recurrent (Raptor) surrogate of a pretrained transformer and report "
                                   "its fidelity and retention beside the truncated and equal-split baselines.",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name, default in {**RUN_DEFAULTS, **FIT_DEFAULTS}.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=type(default), default=default,
                            help=HELP[name])
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rdepth.surrogate.fit import FitConfig
    from rdepth.surrogate.run import SurrogateRunConfig, run_surrogate

    fit = FitConfig(seed=args.seed, **{name: getattr(args, name) for name in FIT_DEFAULTS})
    config = SurrogateRunConfig(fit=fit, **{name: getattr(args, name) for name in RUN_DEFAULTS})
    report = run_surrogate(config)
    print(f"report: {report}")
    return 0
