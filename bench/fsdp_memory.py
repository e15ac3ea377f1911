"""Training-state bytes per rank under FSDP (rdepth train --parallel fsdp) against DDP, measured.

    torchrun --nproc-per-node 2 bench/fsdp_memory.py --preset paper --parallel fsdp --out fsdp.json
    torchrun --nproc-per-node 2 bench/fsdp_memory.py --preset paper --parallel ddp --out ddp.json

Each rank builds the preset's model (the seeded initial weights), wraps it as ``rdepth train``
does (``shard_model`` for fsdp, DistributedDataParallel for ddp), takes one AdamW step on random
tokens (one row of --tokens tokens at --loops per group, to keep it cheap: activations are not
what this measures), then counts the bytes it holds of the parameters, gradients and AdamW's
moments (:func:`rdepth.train.fsdp.local_state_bytes`: the local shards of sharded tensors, whole
tensors otherwise; DDP's gradient buckets are not counted). Rank 0 writes every rank's counts
with :func:`rdepth.train.fsdp.estimate_memory`'s figures beside them. Byte counts, not timings:
the machine's load does not change them. Gloo on the CPU, NCCL with --device cuda.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist


def main() -> None:
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/fsdp_memory.py", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--parallel", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--loops", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from rdepth.config import get_preset
    from rdepth.model import RecurrentLM
    from rdepth.train.config import TrainConfig
    from rdepth.train.fsdp import estimate_memory, local_state_bytes, shard_model
    from rdepth.train.optim import make_optimizer

    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" \
        else torch.device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    config = get_preset(args.preset)
    torch.manual_seed(0)
    model = RecurrentLM(config)
    if args.parallel == "fsdp":
        wrapped = shard_model(model, device)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model.to(device)
        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = make_optimizer(model, TrainConfig(), device)
    idx = torch.randint(0, config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(dist.get_rank()))
    idx = idx.to(device)
    wrapped(idx, idx, (args.loops,) * config.n_groups).loss.backward()
    optimizer.step()
    sizes = local_state_bytes(model, optimizer)
    sizes["total"] = sum(sizes.values())
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, sizes)
    if dist.get_rank() == 0:
        estimate = estimate_memory(config, dist.get_world_size())
        record = {"preset": args.preset, "parallel": args.parallel, "world_size": dist.get_world_size(),
                  "device": str(device), "torch": torch.__version__, "ranks": ranks,
                  "estimate": vars(estimate)}
        text = json.dumps(record, indent=2)
        print(text)
        if args.out:
            with open(args.out, "w") as handle:
                handle.write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/fsdp_memory.py", main))
