"""Shared fixtures: one torch thread for every test, a small real corpus prepared once per session; and the
tiny test model (``from conftest import tiny_model``)."""

from __future__ import annotations

import pytest
import torch

# The tiny test model: 5 layers, two recurrence groups (layer 1; layers 2-3), 3 loops on average.
TINY_MODEL = dict(n_layer=5, n_head=2, d_model=16, block_size=32, vocab_size=50, groups="1|2-3", mean_loops=3.0,
                  backprop_depth=2, init_state_scale=1.0, tokenizer="bpe:512")


def tiny_config(**overrides):
    """:data:`TINY_MODEL` as a ``ModelConfig``, ``overrides`` replacing its fields."""
    from rdepth.config import ModelConfig

    return ModelConfig(**{**TINY_MODEL, **overrides})


def tiny_model(block: str = "sandwich", **overrides):
    """A ``RecurrentLM`` of :func:`tiny_config` in float64, eval mode, its weights drawn after seed 0. A
    ``gpt2`` block's init leaves biases at 0 and norm gains at 1: they are moved off so that they matter."""
    from rdepth.model import RecurrentLM

    torch.manual_seed(0)
    model = RecurrentLM(tiny_config(block=block, **overrides)).double().eval()
    if block == "gpt2":
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 1:
                    param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.fixture(scope="session")
def wiki_small(tmp_path_factory):
    """The default wiki corpus (first 400 articles) with a 512-token BPE."""
    from rdepth.data.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("data") / "wiki512"
    return prepare(PrepareConfig(corpus="wiki", tokenizer="bpe:512", out=out, max_documents=400))



@pytest.fixture(scope="session")
def tiny_text_run(wiki_small, tmp_path_factory):
    """A run of 8 training steps on :func:`wiki_small` (3 layers, groups 1|2, width 32): a checkpoint and a
    tokenizer for the generation and serving commands' tests."""
    from rdepth.cli.main import main

    out = tmp_path_factory.mktemp("gen") / "run"
    assert main(["train", "--data", str(wiki_small), "--out", str(out), "--max-steps", "8", "--batch-size", "4",
                 "--eval-every", "8", "--eval-batches", "1", "--checkpoint-every", "8", "--warmup-steps", "2",
                 "--n-layer", "3", "--n-head", "2", "--d-model", "32", "--block-size", "32", "--groups", "1|2",
                 "--mean-loops", "2", "--threads", "1", "--lr", "3e-3"]) == 0
    return out


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """Every test runs torch on one thread: tiny tensors gain nothing from thread hand-offs, and
    the suite's wall time stays steady on a shared 2-core machine. Commands called in-process plan
    their threads for a 1-core machine (rdepth.threads), so they keep that one thread too."""
    from rdepth.threads import Machine

    monkeypatch.setattr("rdepth.threads.machine", lambda: Machine(cores=1, load=0.0))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def small_chase_data(tmp_path_factory):
    """A prepared pointer-chasing task small enough for a few training steps (8 nodes, 4 queries, context
    32, difficulties 1-3): for tests that train on task data, e.g. two ranks against one process."""
    from rdepth.tasks.data import TaskDataConfig, prepare_task_data

    out = tmp_path_factory.mktemp("chase") / "data"
    return prepare_task_data(TaskDataConfig(task="chase", train_difficulties=(1, 3), train_tokens=6000,
                                            val_tokens=2000, block_size=32, out=out,
                                            task_params='{"chase": {"nodes": 8, "queries": 4, "ordered": true}}'))
