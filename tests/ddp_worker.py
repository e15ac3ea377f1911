"""Launched by tests/test_train.py under torchrun: train, then save this rank's weights."""

import sys

from safetensors.torch import save_file

from rdepth.config import ModelConfig
from rdepth.train.config import TrainConfig
from rdepth.train.trainer import Trainer


def main(data: str, out: str, dump_prefix: str) -> None:
    model_config = ModelConfig(
        n_layer=3, n_head=2, d_model=32, block_size=32, vocab_size=512, groups="1",
        mean_loops=3.0, backprop_depth=2, tokenizer="bpe:512",
    )
    train_config = TrainConfig(
        data=data, out=out, max_steps=4, batch_size=8, grad_accum=2, eval_every=100,
        checkpoint_every=100, log_every=1, eval_batches=1, threads=1,
    )
    trainer = Trainer(model_config, train_config)
    rank = trainer.dist.rank
    trainer.run()
    save_file({k: v.contiguous() for k, v in trainer.stepper.model.state_dict().items()}, f"{dump_prefix}{rank}.safetensors")


if __name__ == "__main__":
    main(*sys.argv[1:4])
