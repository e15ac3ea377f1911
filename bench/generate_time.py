"""``generate()`` alone: median ms/token of greedy decoding at the full budget, batch 1, one thread.

    python bench/generate_time.py [--run TASK_RUN]
    PYTHONPATH=/path/to/an/older/checkout python bench/generate_time.py [--run TASK_RUN]

Run it from two checkouts, alternating, to compare the code's ``rdepth.model.generation.generate`` across
revisions (e.g. the packed path before the one decoder against the decoder); the last generated tokens
are printed so that the outputs can be compared too. Models: ``tiny`` with random weights (seed 0) and,
with ``--run``, a trained run; 48 tokens after a 16-token prompt (fewer where the block ends).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/generate_time.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default=None)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    import torch

    from rdepth.config import get_preset
    from rdepth.model import RecurrentLM
    from rdepth.model.generation import generate
    from rdepth.model.noise import StateNoise

    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = {"tiny": RecurrentLM(get_preset("tiny")).eval()}
    if args.run:
        from rdepth.run.checkpoint import load_model

        models[args.run] = load_model(args.run, torch.device("cpu"))[0].eval()
    for name, model in models.items():
        prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        new = min(48, model.config.block_size - 16)
        out = generate(model, prompt, new, temperature=0, noise=StateNoise(0, [0]))  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            generate(model, prompt, new, temperature=0, noise=StateNoise(0, [0]))
            times.append((time.perf_counter() - start) / new * 1e3)
        print(f"{name}: {statistics.median(times):.3f} ms/token, last tokens {out[0, -8:].tolist()}", flush=True)
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/generate_time.py", main))
