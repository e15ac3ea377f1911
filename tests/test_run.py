"""The run layer: the one evaluation loop, its noise keyed by window, loss masks, opened runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rdepth.config import ModelConfig
from rdepth.errors import RdepthError
from rdepth.model import RecurrentLM
from rdepth.model.noise import StateNoise
from rdepth.run.evaluate import eval_outputs, evaluate
from rdepth.run.heldout import check_vocabulary, held_out_windows


def tiny() -> RecurrentLM:
    torch.manual_seed(0)
    config = ModelConfig(n_layer=3, n_head=2, d_model=16, block_size=12, vocab_size=40, groups="1",
                         mean_loops=3.0, backprop_depth=2, tokenizer="bpe:40")
    return RecurrentLM(config).double()


def windows(count: int = 7) -> torch.Tensor:
    tokens = np.random.default_rng(0).integers(0, 40, size=count * 12 + 1)
    return held_out_windows(tokens, 12)


def test_evaluation_does_not_depend_on_the_batch_size():
    """Window i starts from its own noise, so batching changes nothing (beyond float rounding)."""
    model, held_out = tiny(), windows()
    results = [evaluate(model, held_out, loop_counts=3, batch_size=size, seed=4) for size in (1, 3, 7)]
    assert results[0]["tokens"] == 7 * 12
    for other in results[1:]:
        assert other["ce"] == pytest.approx(results[0]["ce"], rel=1e-6, abs=0)  # the loss is float32
    assert abs(evaluate(model, held_out, loop_counts=3, seed=5)["ce"] - results[0]["ce"]) > 1e-4


def test_evaluation_equals_a_hand_written_loop():
    model, held_out = tiny(), windows(4)
    with torch.no_grad():
        out = model(held_out[:, :-1], held_out[:, 1:], 2, noise=StateNoise.consecutive(0, 0, 4))
    assert evaluate(model, held_out, loop_counts=2, batch_size=2)["ce"] == pytest.approx(float(out.loss), rel=1e-6)


def test_masks_score_only_the_masked_targets():
    model, held_out = tiny(), windows(3)
    masks = torch.zeros_like(held_out, dtype=torch.bool)
    masks[:, 5] = masks[:, 9] = True  # targets y[:, 4] and y[:, 8]
    result = evaluate(model, held_out, loop_counts=2, batch_size=2, masks=masks)
    with torch.no_grad():
        logits = model(held_out[:, :-1], None, 2, noise=StateNoise.consecutive(0, 0, 3)).logits
    picked = logits[:, [4, 8]].reshape(-1, 40)
    expected = F.cross_entropy(picked, held_out[:, [5, 9]].reshape(-1))
    assert result["tokens"] == 6
    assert result["ce"] == pytest.approx(float(expected), rel=1e-6)
    assert result["ppl"] == pytest.approx(math.exp(result["ce"]))


def test_eval_outputs_restores_train_mode():
    model, held_out = tiny(), windows(2)
    model.train()
    with torch.no_grad():
        for _ in eval_outputs(model, held_out, lambda x, y, noise: model(x, y, 1, noise=noise), batch_size=1):
            assert not model.training
    assert model.training


def test_vocabulary_check_names_the_problem():
    with pytest.raises(RdepthError, match="vocabulary of 40"):
        check_vocabulary(torch.tensor([[1, 2, 40]]), 40)


def test_unigram_baseline_on_the_evaluated_tokens():
    from rdepth.run.evaluate import unigram_baseline

    log_probs = np.log(np.full(40, 1 / 40))
    log_probs[3] = np.log(0.5)
    held_out = torch.tensor([[1, 3, 3, 5], [2, 3, 7, 3]])  # targets: 3 3 5 / 3 7 3
    result = unigram_baseline(held_out, log_probs)
    expected = -(4 * np.log(0.5) + 2 * np.log(1 / 40)) / 6
    assert result["tokens"] == 6 and result["ce"] == pytest.approx(expected)
    masks = torch.zeros_like(held_out, dtype=torch.bool)
    masks[:, 2] = True  # targets 3 and 7 only
    assert unigram_baseline(held_out, log_probs, masks)["ce"] == pytest.approx(-(np.log(0.5) + np.log(1 / 40)) / 2)


def test_help_shows_preset_defaults_and_the_demo_keeps_everything_under_out(capsys):
    """Issue 17: --help shows each preset's value; the demo's data folder defaults to OUT/data;
    prepare, train and the demo agree on the default data folder."""
    from rdepth.cli.main import main
    from rdepth.data.prepare import PrepareConfig
    from rdepth.demo.run import DemoConfig
    from rdepth.train.config import TrainConfig

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tiny 6" in text and "paper 768" in text
    assert DemoConfig(out="somewhere").data == "somewhere/data"
    assert str(PrepareConfig().out) == TrainConfig().data == "data/wiki-bpe4096"
