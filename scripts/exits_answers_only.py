"""Where an exit rule loses accuracy on a task: its own answer tokens, or the context tokens later answers read.

For each rule and threshold, answer accuracy on the task's held-out sets twice: with the rule deciding for every
position (as ``rdepth sweep`` runs it), and with the rule deciding for the answer positions only while every
other position runs to the cap (its later loop steps still feed the answers through attention). The gap is
what stopping the context tokens costs; the rest, against the full budget, is the rule's own premature stops.

    OMP_NUM_THREADS=1 python scripts/exits_answers_only.py --checkpoint RUN --data DATA \\
        --setting kl=0.01 --setting confidence=0.01 --setting learned=0.01 --difficulties 1,2,3,4,6,8
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from rdepth.exits.controller import controller_factory
from rdepth.run.checkpoint import load_model
from rdepth.tasks.data import load_heldout
from rdepth.tasks.evaluate import heldout_accuracy


class AnswersOnly:
    """A loop controller around ``inner`` whose rows stop early only where ``answer`` ``[N]`` is True."""

    def __init__(self, inner, answer: torch.Tensor):
        self.inner, self.answer = inner, answer

    def max_steps(self, group):
        return self.inner.max_steps(group)

    def begin(self, group, state):
        self.inner.begin(group, state)

    def after_step(self, group, step, rows, prev, new):
        done, handoff, used = self.inner.after_step(group, step, rows, prev, new)
        return done & self.answer[rows], handoff, used


def accuracy(model, heldout, factory, batch_size: int, answers_only: bool) -> dict:
    if not answers_only:
        return heldout_accuracy(model, heldout, controller_factory=factory, batch_size=batch_size)
    masks = torch.from_numpy(np.asarray(heldout.answer_mask[:, 1:], dtype=bool))  # targets that are answers
    first = [0]

    def restricted():  # heldout_accuracy asks for one controller per batch, in order
        rows = masks[first[0]: first[0] + batch_size].reshape(-1)
        first[0] += batch_size
        return AnswersOnly(factory(), rows)

    return heldout_accuracy(model, heldout, controller_factory=restricted, batch_size=batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--setting", action="append", required=True, help="POLICY=TAU (repeatable)")
    parser.add_argument("--difficulties", default="1,2,3,4,6,8")
    parser.add_argument("--k-max", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, config = load_model(args.checkpoint)
    k_max = [args.k_max] * model.n_groups
    heldouts = [load_heldout(args.data, int(d)) for d in args.difficulties.split(",")]
    print(f"{'setting':<22}{'exits':<14}" + "".join(f"{'d' + str(h.difficulty):>7}" for h in heldouts)
          + f"{'mean':>7}{'answer steps':>14}")
    for setting in args.setting:
        name, tau = setting.split("=")
        options = {"gate": args.checkpoint} if name == "learned" else {}
        factory = controller_factory(name, float(tau), k_max, lambda: model.readout, options)
        for answers_only in (False, True):
            results = [accuracy(model, h, factory, args.batch_size, answers_only) for h in heldouts]
            accuracies = [100 * r["accuracy"] for r in results]
            steps = np.mean([r["mean_steps_answer"] for r in results])
            print(f"{setting:<22}{'answers only' if answers_only else 'every token':<14}"
                  + "".join(f"{a:7.1f}" for a in accuracies) + f"{np.mean(accuracies):7.1f}{steps:14.2f}", flush=True)


if __name__ == "__main__":
    main()
