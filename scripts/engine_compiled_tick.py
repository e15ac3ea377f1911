"""A study for the engine's next step: the device work of one continuous-depth-batching tick with an exit
rule, written with static shapes (every slot, the whole capacity, rows predicated) and compiled, against
the same function eager.

    python scripts/engine_compiled_tick.py --run runs/cdb/s0/train [--batch 16] [--repeats 300]

The tick: one loop step of the model's one looped group for every slot, each row at its own loop step and
position (its key written through to the later step slots, its own step's slot gathered), the ``kl`` rule
(the head's reading, its log-softmax and the divergence from the row's previous reading), and each row's
greedy token with a finiteness check, read by the host once. This is not the engine (no queue, no token
bookkeeping): it measures how much of a tick's cost is the kernels' launch and how much their arithmetic.
Prints the device, the eager and compiled microseconds a tick (median of interleaved repeats), their
ratio, the largest difference between the two, and where the compiled tick's time goes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(model, batch: int):
    import torch

    from rdepth.model.kv import AttentionContext

    config = model.config
    if model.n_groups != 1 or len(model.stages) != 1:
        raise SystemExit("engine_compiled_tick: a model whose only stage is one looped group (the task models)")
    cap, steps_kept, heads, head_dim = config.block_size, 12, config.n_head, config.head_dim
    keys = torch.zeros(steps_kept, batch, heads, cap, head_dim)
    values = torch.zeros_like(keys)
    slot_numbers = torch.arange(1, steps_kept + 1).view(1, steps_kept, 1, 1)
    rows = torch.arange(batch)
    causal = (torch.arange(cap)[None, :] <= torch.arange(cap)[:, None]).view(cap, 1, 1, cap)

    class Store:
        def __init__(self, tables, steps, positions):
            self.tables, self.steps, self.positions = tables, steps, positions

        def update(self, layer, ctx, new_keys, new_values):
            keys, values, rows, slot_numbers = self.tables
            out = []
            for cache, new in ((keys, new_keys), (values, new_values)):
                new = new.squeeze(2)  # (B, nh, hs)
                column = cache[:, rows, :, self.positions]  # (B, K, nh, hs)
                through = slot_numbers >= self.steps.view(-1, 1, 1, 1)
                cache[:, rows, :, self.positions] = torch.where(through, new[:, None], column)
                flat = cache.view(-1, *cache.shape[2:])
                out.append(flat.index_select(0, (self.steps - 1) * rows.shape[0] + rows))
            return tuple(out)

    def tick(state, projected, steps, positions, previous, tables, causal, tau: float):
        rows = tables[2]
        ctx = AttentionContext(Store(tables, steps, positions), 0, rows, positions, rows, 1, rows.shape[0],
                               causal.index_select(0, positions), one_per_row=True)
        new = model.loop_step(0, state, projected, ctx)
        logits = model.readout(new)
        log_probs = torch.log_softmax(logits, -1)
        divergence = (log_probs.exp() * (log_probs - previous)).sum(-1)
        exits = ((divergence < tau) & (steps != 1)) | (steps == tables[0].shape[0])
        greedy = torch.where(torch.isfinite(logits).all(-1), logits.argmax(-1), -1)
        return new, log_probs, torch.stack([exits.long(), greedy])

    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(batch, config.d_model, generator=generator),
              torch.randn(batch, config.d_model, generator=generator),
              torch.randint(1, 7, (batch,), generator=generator),
              torch.randint(0, cap - 1, (batch,), generator=generator),
              torch.zeros(batch, config.vocab_size), (keys, values, rows, slot_numbers), causal, 0.03)
    return tick, inputs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a trained task run's train/ folder (one looped group)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args(argv)
    import torch
    from torch.profiler import profile

    from rdepth.run.checkpoint import load_model

    torch.set_num_threads(1)
    model = load_model(args.run, torch.device("cpu"))[0].eval().requires_grad_(False)
    tick, inputs = build(model, args.batch)
    start = time.perf_counter()
    compiled = torch.compile(tick, dynamic=False, fullgraph=True)
    with torch.inference_mode():
        compiled(*inputs)
    print(f"engine_compiled_tick: {_cpu()}, torch {torch.__version__}, 1 thread, B = {args.batch}; "
          f"compiled in {time.perf_counter() - start:.1f} s", flush=True)
    times = {"eager": [], "compiled": []}
    with torch.inference_mode():
        for _ in range(10):
            tick(*inputs)
            compiled(*inputs)
        for _ in range(5):
            for name, function in (("eager", tick), ("compiled", compiled)):
                begin = time.perf_counter()
                for _ in range(args.repeats // 5):
                    function(*inputs)[2].tolist()
                times[name].append((time.perf_counter() - begin) / (args.repeats // 5) * 1e6)
        eager, fused = tick(*inputs), compiled(*inputs)
        with profile() as trace:
            for _ in range(50):
                compiled(*inputs)[2].tolist()
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"eager {medians['eager']:.0f} us a tick, compiled {medians['compiled']:.0f} us "
          f"({medians['eager'] / medians['compiled']:.2f}x); largest state difference "
          f"{(eager[0] - fused[0]).abs().max().item():.2e}, decisions equal: {bool((eager[2] == fused[2]).all())}")
    print(trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
    return 0


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "cpu"


if __name__ == "__main__":
    sys.exit(main())
