"""Launched by tests/test_fsdp.py under torchrun: train the test's tiny model in float64 with the
TrainConfig fields given as JSON.

argv: JSON {"train": {TrainConfig fields}, "resume": bool, "kill_at": step or null}. ``kill_at``:
rank 0 kills itself (SIGKILL) as that step (0-based) starts, a crash mid-run."""

import json
import os
import signal
import sys

import torch


def main(spec: dict) -> None:
    torch.set_default_dtype(torch.float64)  # exact-arithmetic comparisons: only reduction order differs
    from rdepth.config import ModelConfig
    from rdepth.train.config import TrainConfig
    from rdepth.train.trainer import Trainer

    model_config = ModelConfig(n_layer=3, n_head=2, d_model=32, block_size=32, vocab_size=512, groups="1",
                               mean_loops=3.0, backprop_depth=2, tokenizer="bpe:512")
    trainer = Trainer(model_config, TrainConfig(**spec["train"]), resume=spec.get("resume", False))
    step_fn, kill_at = trainer.stepper.train_step, spec.get("kill_at")

    def train_step(step):
        if step == kill_at and trainer.dist.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return step_fn(step)

    trainer.stepper.train_step = train_step
    trainer.run()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
