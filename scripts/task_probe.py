"""Probe: does a small looped transformer need its loops on a built-in task? (CPU, one thread)

Trains ``rdepth.model.RecurrentLM`` on problems of one task sampled on the fly
(whole problems packed into windows of ``block + 1`` tokens, loss on the answer
tokens only: every other target is -1), with AdamW, linear warm-up and cosine
decay, and optionally a difficulty curriculum (the largest training difficulty
grows by one when the running answer-token accuracy on problems of the current
largest reaches ``--curriculum``). Then prints exact-match accuracy per difficulty at
each test loop count, and the same for a no-loop baseline (same layers,
``groups=""``) trained with the same data, steps and seed when ``--baseline``.

Example (the best recipe measured so far, 2026-11-26: ordered pointer chasing with one problem
per window, every symbol queried and every distractor chain as long as the main one, so that no
shortcut answers; 2 layers with layer 1 looped; 2,600 steps, 9 min on a 2-core CPU: 86.5% at
difficulty 4 with 4 loops against 1.0% at 1 loop, still rising with loops at difficulty 8)::

    OMP_NUM_THREADS=1 timeout 900 python scripts/task_probe.py --task chase \
        --task-params '{"nodes":16,"queries":16,"ordered":true,"min_distractor_hops":15}' \
        --train-min 1 --train-max 4 --eval-difficulties 2,3,4,6,8 --block 64 --n-layer 2 --groups 1 \
        --mean-loops 6 --backprop-depth 4 --lr 3e-3 --steps 2600 --time-limit 690 --out /tmp/probe.json
    # the no-loop baseline with the same data and steps:
    ... same flags ... --baseline-only

Training stops at ``--steps``, ``--stop-step`` or ``--time-limit``, whichever
comes first (the cosine schedule always spans ``--steps``): on a shared CPU the
time limit decides how many steps a run gets, so compare runs by their steps.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

from rdepth.config import ModelConfig
from rdepth.data.task_vocab import TaskVocab
from rdepth.model import RecurrentLM
from rdepth.tasks import answer_accuracy, get_task, pack_windows, task_spec


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="chase")
    parser.add_argument("--task-params", default="{}", help='JSON overrides, e.g. \'{"nodes": 16}\'')
    parser.add_argument("--train-min", type=int, default=1)
    parser.add_argument("--train-max", type=int, default=6)
    parser.add_argument("--eval-difficulties", default="", help="comma list (default: train max, 1.5x, 2x and a few below)")
    parser.add_argument("--steps", type=int, default=1200, help="schedule length (cosine ends here)")
    parser.add_argument("--time-limit", type=float, default=0, help="stop training after this many seconds (0: none)")
    parser.add_argument("--stop-step", type=int, default=0, help="stop training at this step, schedule unchanged (0: --steps)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=3)
    parser.add_argument("--groups", default="1")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--mean-loops", type=float, default=4.0)
    parser.add_argument("--backprop-depth", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--curriculum", type=float, default=0.8, help="running answer-token accuracy at the top difficulty that raises it (0: off)")
    parser.add_argument("--curriculum-steps", type=int, default=0,
                        help="raise the top difficulty linearly from train-min + 1 to train-max over this many "
                             "steps instead of by accuracy (0: off)")
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--loops", default="1,2,4,8,16")
    parser.add_argument("--baseline", action="store_true", help="also train the no-loop model (groups='')")
    parser.add_argument("--baseline-only", action="store_true", help="train only the no-loop model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--out", default="", help="write the results as JSON here")
    return parser.parse_args()


def batch_of(task, rng: np.random.Generator, difficulties: list[int], batch: int, width: int):
    """(x, targets [B, width-1] with -1 off answers, ids [B, width-1], problem difficulties)."""
    per_window = max(1, width // (task.length(max(difficulties)) + 1))
    problems = [task.sample(rng, int(rng.choice(difficulties))) for _ in range(batch * per_window + per_window)]
    windows = pack_windows(problems, width)
    tokens = torch.from_numpy(windows.tokens[:batch])
    mask = torch.from_numpy(windows.answer_mask[:batch, 1:])
    targets = torch.where(mask, tokens[:, 1:], torch.full_like(tokens[:, 1:], -1))
    return tokens[:, :-1].contiguous(), targets, windows.problem_ids[:batch, 1:], [p.difficulty for p in problems]


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    low = args.lr * args.min_lr_ratio
    return low + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - low)


class Curriculum:
    """The largest training difficulty: --train-max throughout; or from --train-min + 1, raised by one when
    the running answer-token accuracy on its problems reaches --curriculum, or linearly over
    --curriculum-steps."""

    def __init__(self, args):
        self.low, self.high = args.train_min, args.train_max
        self.threshold, self.steps = args.curriculum, args.curriculum_steps
        self.scheduled = self.steps > 0
        self.current = min(self.low + 1, self.high) if (self.threshold > 0 or self.scheduled) else self.high
        self.running = 0.0

    def difficulties(self, step: int) -> list[int]:
        """The difficulties a batch of ``step`` draws from."""
        low, high = self.low, self.high
        if self.scheduled:
            self.current = min(high, low + 1 + (high - low - 1) * step // self.steps) if high > low else high
        return list(range(low, self.current + 1))

    def observe(self, step: int, logits, targets, ids, difficulties: list[int]) -> None:
        """Follow the answer-token accuracy on the problems of the current top difficulty; raise it at the
        threshold (the accuracy-driven curriculum only)."""
        if not (self.threshold > 0 and not self.scheduled and self.current < self.high):
            return
        top = np.isin(ids, [i for i, d in enumerate(difficulties) if d == self.current])
        if top.any():  # answer-token accuracy on the problems of the current top difficulty
            right = logits.detach().argmax(-1).numpy()[top] == targets.numpy()[top]
            self.running = 0.9 * self.running + 0.1 * float(right.mean())
        if self.running >= self.threshold:
            self.current, self.running = self.current + 1, 0.0
            print(f"  step {step}: curriculum -> difficulties {self.low}..{self.current}", flush=True)


def _model_and_optimizer(args, task, groups: str):
    config = ModelConfig(n_layer=args.n_layer, n_head=args.heads, d_model=args.d_model,
                         block_size=args.block, vocab_size=TaskVocab.vocab_size, groups=groups,
                         mean_loops=args.mean_loops, backprop_depth=args.backprop_depth,
                         tokenizer=task_spec([task.name]))
    model = RecurrentLM(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    return model, optimizer


def _stopped(args, step: int, started: float) -> bool:
    """--time-limit passed or --stop-step reached (the schedule still spans --steps)."""
    return bool((args.time_limit and time.perf_counter() - started > args.time_limit) or
                (args.stop_step and step >= args.stop_step))


def _optimizer_step(model, optimizer, x, targets, lr: float):
    for group in optimizer.param_groups:
        group["lr"] = lr
    output = model(x, targets)
    optimizer.zero_grad(set_to_none=True)
    output.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return output


def _log(groups: str, step: int, output, targets, curriculum: Curriculum, tokens_seen: int, started: float) -> None:
    elapsed = time.perf_counter() - started
    answers = targets >= 0
    token_accuracy = (output.logits.detach().argmax(-1)[answers] == targets[answers]).float().mean()
    print(f"  [{groups or 'no loop'}] step {step} loss {output.loss.item():.3f} answer tokens "
          f"{100 * token_accuracy:.0f}% max difficulty {curriculum.current} "
          f"running {curriculum.running:.2f} {tokens_seen / elapsed:.0f} tok/s {elapsed:.0f} s", flush=True)


def train(args, task, groups: str) -> tuple[RecurrentLM, dict]:
    torch.manual_seed(args.seed)
    rng = np.random.default_rng([args.seed, 0])
    model, optimizer = _model_and_optimizer(args, task, groups)
    curriculum = Curriculum(args)
    started, step, tokens_seen = time.perf_counter(), 0, 0
    model.train()
    for step in range(args.steps):
        if _stopped(args, step, started):
            break
        x, targets, ids, difficulties = batch_of(task, rng, curriculum.difficulties(step), args.batch, args.block + 1)
        output = _optimizer_step(model, optimizer, x, targets, lr_at(step, args))
        tokens_seen += x.numel()
        curriculum.observe(step, output.logits, targets, ids, difficulties)
        if step % args.log_every == 0:
            _log(groups, step, output, targets, curriculum, tokens_seen, started)
    seconds = time.perf_counter() - started
    return model, {"steps": step + 1, "seconds": round(seconds, 1), "tokens": tokens_seen,
                   "final_max_difficulty": curriculum.current, "parameters": model.num_parameters()}


@torch.no_grad()
def evaluate(args, task, model: RecurrentLM, difficulties: list[int], loop_budgets: list[int | None]) -> dict:
    """{difficulty: {loops: exact-match accuracy}} on fresh problems (seed stream 1, whole windows)."""
    model.eval()
    results: dict[int, dict] = {}
    for difficulty in difficulties:
        rng = np.random.default_rng([args.seed, 1, difficulty])
        problems = [task.sample(rng, difficulty) for _ in range(args.eval_problems)]
        windows = pack_windows(problems, args.block + 1)
        x = torch.from_numpy(windows.tokens[:, :-1])
        targets = windows.tokens[:, 1:]
        results[difficulty] = {}
        for loops in loop_budgets:
            generator = torch.Generator().manual_seed(args.seed)
            logits = model(x, loop_counts=loops, noise=generator).logits
            accuracy = answer_accuracy(logits, targets, windows.answer_mask[:, 1:], windows.problem_ids[:, 1:])
            results[difficulty][str(loops or 1)] = round(100 * accuracy, 1)
    return results


def print_table(title: str, results: dict) -> None:
    budgets = list(next(iter(results.values())))
    print(f"\n{title}: exact match % per difficulty at test loops {' / '.join(budgets)}")
    for difficulty, row in results.items():
        print(f"  d={difficulty:>3}: " + " / ".join(f"{row[b]:5.1f}" for b in budgets))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    task = get_task(args.task, **json.loads(args.task_params))
    high = args.train_max
    if args.eval_difficulties:
        difficulties = [int(d) for d in args.eval_difficulties.split(",")]
    else:
        wanted = {max(args.train_min, high // 2), high, math.ceil(1.5 * high), 2 * high}
        difficulties = sorted(d for d in wanted if task.min_difficulty <= d <= task.max_difficulty)
    for difficulty in difficulties + [args.train_min, high]:
        task.check_fits(difficulty, args.block + 1)
    budgets = [int(b) for b in args.loops.split(",")]
    print(f"task {task} train {args.train_min}..{high} eval {difficulties}; {args.n_layer} layers groups "
          f"{args.groups!r} d={args.d_model} mean loops {args.mean_loops} lr {args.lr}", flush=True)
    summary = {"args": vars(args), "task": task.describe(), "runs": {}}

    if not args.baseline_only:
        model, info = train(args, task, args.groups)
        looped = evaluate(args, task, model, difficulties, budgets)
        summary["runs"]["looped"] = {**info, "accuracy": looped}
        print(f"looped: {info}")
        print_table(f"looped model (groups {args.groups!r})", looped)
    if args.baseline or args.baseline_only:
        model, info = train(args, task, "")
        plain = evaluate(args, task, model, difficulties, [None])
        summary["runs"]["no_loop"] = {**info, "accuracy": plain}
        print(f"no-loop baseline: {info}")
        print_table("no-loop baseline (groups '')", plain)
    if args.out:
        from rdepth.io import json_text  # standard JSON: a NaN or infinity is null
        with open(args.out, "w") as handle:
            handle.write(json_text(summary, indent=2))


if __name__ == "__main__":
    main()
