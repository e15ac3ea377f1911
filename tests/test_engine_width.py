"""bench/engine_width.py: the scheduled controller stops rows where its distribution says (in the engine and the
lock-step decoder alike), the widened model keeps the head width, and the table's ratios are the maths they
claim, on a tiny model end to end."""

from __future__ import annotations

from argparse import Namespace

import numpy as np
import pytest
import torch
from conftest import tiny_model

from bench.engine_width import ScheduledController, wide_model, width_rows
from rdepth.engine import Engine, Request
from rdepth.model.decoder import Decoder


def engine_steps(model, probs, prompts) -> list[int]:
    engine = Engine(model, 3, controller_factory=lambda: ScheduledController(probs, 0))
    for prompt in prompts:
        engine.add_request(Request(prompt, max_tokens=2))
    return [steps[group] for done in engine.run() for steps in done.steps for group in range(model.n_groups)]


def test_a_one_step_distribution_stops_every_row_there_in_the_engine_and_the_decoder():
    model = tiny_model(n_layer=1, groups="0")
    probs = np.array([0.0, 0.0, 1.0, 0.0])
    assert set(engine_steps(model, probs, [[1, 2, 3], [4, 5], [6, 7, 8, 9], [1]])) == {3}
    decoder = Decoder(model, 2, controller_factory=lambda: ScheduledController(probs, 0))
    decoder.prefill(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert decoder.prompt_computed.unique().tolist() == [3]


def test_the_steps_follow_the_distribution_and_bad_probabilities_are_refused():
    model = tiny_model(n_layer=1, groups="0")
    steps = engine_steps(model, np.array([0.0, 0.5, 0.5]), [[i % 50] * 12 for i in range(8)])
    assert set(steps) == {2, 3}  # both drawn over 96 positions, nothing else
    for bad in ([], [-0.5, 1.5], [0.0, 0.0]):
        with pytest.raises(ValueError):
            ScheduledController(np.array(bad), 0)


def test_the_wide_model_keeps_the_head_width():
    config = tiny_model(n_layer=1, groups="0").config  # d 16, 2 heads of 8
    model = wide_model(config, 64, config.head_dim, 0)
    assert (model.config.d_model, model.config.n_head, model.config.head_dim) == (64, 8, 8)
    from rdepth.errors import RdepthError

    with pytest.raises(RdepthError, match="not a multiple of the head width"):  # one line, exit 2 (issue 61)
        wide_model(config, 60, config.head_dim, 0)


def test_the_table_is_the_ratio_of_the_rates_against_the_bound():
    model = tiny_model(n_layer=1, groups="0").float()
    windows = np.random.default_rng(0).integers(0, 50, (6, 5))
    args = Namespace(fixed=3, seed=0, batch=2, rounds=2, warmup=0, device="cpu", tick_list=["eager", "static"])
    rows = width_rows(model, windows, np.arange(6), np.array([0.5, 0.5, 0.0]), args)
    fastest = max(rows[f"{path} | fixed"]["tokens_per_s"] for path in ("engine", "engine static"))
    for path in ("engine", "engine static", "lockstep"):
        rule, fixed = rows[f"{path} | scheduled"], rows[f"{path} | fixed"]
        assert fixed["steps"] == 3.0 and 1.0 <= rule["steps"] <= 2.0
        base = fixed["tokens_per_s"] if path == "lockstep" else fastest  # the engine's: its fastest tick at F
        assert rule["ratio"] == pytest.approx(rule["tokens_per_s"] / base)
        assert rule["bound"] == pytest.approx(3.0 / rule["paid"])
        assert rule["share"] == pytest.approx(rule["ratio"] / rule["bound"])
    assert rows["lockstep | scheduled"]["paid"] >= rows["lockstep | scheduled"]["steps"]  # the slowest row's
