"""Ops and bytes moved per decoded token by batched exits: predicated, compacted, fixed budgets.

    python bench/compaction_traffic.py [--preset paper] [--batch 32] [--json out.json]
    PYTHONPATH=/path/to/other/checkout python bench/compaction_traffic.py ...   # the same on other code

Counts, not times: every aten op a token runs (views and allocations apart) and the bytes it reads and
writes, from its tensor arguments' sizes (``TorchDispatchMode``; an indexed write counts the values it
writes, a gather the rows it copies, any other op its inputs and outputs). On a GPU at batch >= 8 a
decode token is bound by memory traffic and launches, so these predict the CUDA costs; ``kv_copy_bytes``
is the traffic of the ops that gather keys/values into new tensors (``index_select``/``index`` over a
key/value store), which compaction by indexing removes.

The rows' exit steps are drawn from a trained model's recorded histogram (``bench/exit_histogram.json``,
:mod:`exit_spread`), so the batch leaves the loop as a trained batch would, on random weights. Runs on
whichever ``rdepth`` is importable (the checkout this file sits in when none is), so the same script
measures two revisions; it prints the one it used.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import rdepth  # noqa: F401  (another checkout's, when PYTHONPATH names one)
except ImportError:
    sys.path.insert(0, str(HERE.parent))

from exit_spread import DEFAULT_HISTOGRAM, factory, load_histogram  # noqa: E402

VIEWS = {"view", "_unsafe_view", "narrow", "select", "slice", "expand", "transpose", "t", "permute", "unsqueeze",
         "squeeze", "as_strided", "unbind", "alias", "detach", "split", "chunk", "reshape", "split_with_sizes",
         "empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "_reshape_alias", "view_as"}
WRITES = {"index_put_", "index_put", "_index_put_impl_", "index_copy_", "index_copy", "masked_scatter_"}
GATHERS = {"index_select", "index", "gather", "take"}


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


class Traffic(TorchDispatchMode):
    """Per aten op (by name): calls and bytes read + written; ``kv_copy_bytes``: gathers of >= 4-dim inputs."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.moved: Counter = Counter()
        self.kv_copy_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if name in VIEWS:
            return out
        if name in WRITES:
            values = args[2] if len(args) > 2 else kwargs.get("values", kwargs.get("source"))
            moved = 2 * _bytes(values) + _bytes(args[1])
        elif name in GATHERS:
            moved = 2 * _bytes(out) + _bytes(args[1:])
            if isinstance(args[0], torch.Tensor) and args[0].dim() >= 4:
                self.kv_copy_bytes += 2 * _bytes(out)
        else:
            inputs = _bytes(list(args)) + _bytes(list(kwargs.values()))
            written = 0 if name.endswith("_") else _bytes(out)  # in place: counted with the inputs
            moved = inputs + written
        self.calls[name] += 1
        self.moved[name] += moved
        return out


def measure(decoder, prompt, stream) -> dict:
    """Prefill ``prompt`` (uncounted), then count the ops/bytes of decoding ``stream`` ``[B, n]`` per token."""
    decoder.prefill(prompt)
    traffic = Traffic()
    executed = []
    with traffic, torch.no_grad():
        for t in range(stream.shape[1]):
            decoder.step(stream[:, t:t + 1])
            executed.append(decoder.computed.float().mean(dim=1))
    tokens = stream.shape[1]
    top = sorted(traffic.moved.items(), key=lambda item: -item[1])[:8]
    return {"ops_per_token": sum(traffic.calls.values()) / tokens,
            "mbytes_per_token": sum(traffic.moved.values()) / tokens / 1e6,
            "kv_copy_mbytes_per_token": traffic.kv_copy_bytes / tokens / 1e6,
            "mean_steps_per_group": torch.stack(executed).mean(dim=0).tolist(),
            "top_ops_mbytes": {name: moved / tokens / 1e6 for name, moved in top},
            "top_ops_calls": {name: traffic.calls[name] / tokens for name, _ in top}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--check-every", type=int, default=2)
    parser.add_argument("--histogram", default=str(DEFAULT_HISTOGRAM))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import rdepth
    from rdepth.config import get_preset
    from rdepth.model.decoder import Decoder
    from rdepth.model.noise import StateNoise
    from rdepth.model.recurrent import RecurrentLM

    config = get_preset(args.preset)
    torch.manual_seed(args.seed)
    model = RecurrentLM(config).eval()
    k_max = (args.k_max,) * model.n_groups
    histogram = load_histogram(args.histogram)
    spread = factory(histogram, k_max, seed=args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.prompt + args.tokens), generator=generator)
    prompt, stream = ids[:, :args.prompt], ids[:, args.prompt:]
    noise = StateNoise(args.seed, range(args.batch))
    capacity = args.prompt + args.tokens
    rows = {}
    exits = dict(controller_factory=spread, noise=noise, check_every=args.check_every, capacity=capacity)
    settings = {"full": dict(loop_counts=k_max, noise=noise, capacity=capacity),
                "predicated": exits, "compacted": dict(exits, compact=True)}
    for name, options in settings.items():
        rows[name] = measure(Decoder(model, args.batch, k_max, **options), prompt, stream)
    mean = [round(m) for m in rows["predicated"]["mean_steps_per_group"]]
    rows["matched_fixed"] = measure(Decoder(model, args.batch, k_max, loop_counts=tuple(max(1, m) for m in mean),
                                            noise=noise, capacity=capacity), prompt, stream)
    report = {"rdepth": str(Path(rdepth.__file__).resolve().parent), "preset": args.preset, "batch": args.batch,
              "k_max": args.k_max, "check_every": args.check_every, "prompt": args.prompt, "tokens": args.tokens,
              "histogram": {"path": args.histogram, "source": histogram.get("source")},
              "torch": torch.__version__, "results": rows}
    print(f"rdepth from {report['rdepth']}; preset {args.preset}, batch {args.batch}, k_max {args.k_max}, "
          f"check every {args.check_every}, positions {args.prompt}..{capacity - 1}")
    print(f"{'setting':<14} {'ops/token':>10} {'MB/token':>10} {'KV copies MB':>13}  mean steps per group")
    for name, row in rows.items():
        steps = ", ".join(f"{s:.2f}" for s in row["mean_steps_per_group"])
        print(f"{name:<14} {row['ops_per_token']:>10.1f} {row['mbytes_per_token']:>10.2f} "
              f"{row['kv_copy_mbytes_per_token']:>13.2f}  {steps}")
    if args.json:
        from rdepth.io import json_text  # standard JSON: a NaN or infinity is null
        Path(args.json).write_text(json_text(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
