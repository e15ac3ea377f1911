"""Launched by tests/test_fsdp.py under torchrun: train the tiny model of the test in float64 with the TrainConfig fields given as JSON.

argv: JSON {"train": {TrainConfig fields}, "resume": bool, "kill_at": step or null,
"measure": path or null}. ``kill_at``: rank 0 kills itself (SIGKILL) as that step starts, a
crash mid-run. ``measure``: each rank writes the bytes of its parameters, gradients and optimizer
state after the first step to ``measure`` + rank + ".json"."""

import json
import os
import signal
import sys

import torch


def main(spec: dict) -> None:
    torch.set_default_dtype(torch.float64)  # exact-arithmetic comparisons: only reduction order differs
    from rdepth.config import ModelConfig, get_preset
    from rdepth.train.config import TrainConfig
    from rdepth.train.fsdp import local_state_bytes
    from rdepth.train.trainer import Trainer

    if spec.get("preset"):
        torch.set_default_dtype(torch.float32)
        model_config = get_preset(spec["preset"], **spec.get("model", {}))
    else:
        model_config = ModelConfig(n_layer=3, n_head=2, d_model=32, block_size=32, vocab_size=512, groups="1",
                                   mean_loops=3.0, backprop_depth=2, tokenizer="bpe:512")
    trainer = Trainer(model_config, TrainConfig(**spec["train"]), resume=spec.get("resume", False))
    step_fn = trainer.train_step
    kill_at, measure = spec.get("kill_at"), spec.get("measure")

    def train_step(step):
        if step == kill_at and trainer.dist.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        out = step_fn(step)
        if measure and step == trainer.start_step:
            grads = [p for p in trainer.model.parameters()]
            sizes = local_state_bytes(trainer.model, trainer.optimizer)
            with open(f"{measure}{trainer.dist.rank}.json", "w") as handle:
                json.dump({**sizes, "world_size": trainer.dist.world_size,
                           "parameters_total": sum(p.numel() for p in grads)}, handle)
        return out

    trainer.train_step = train_step
    trainer.run()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
