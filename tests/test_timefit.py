"""A training time limit: the trainer times itself and ends its cosine schedule sooner, never later;
the cadences follow the first fit, a resumed run keeps the fitted schedule, and a finished one is reused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from reliability_helpers import error_line, train_argv
from safetensors.torch import load_file

from rdepth.cli.main import main
from rdepth.errors import RdepthError
from rdepth.io import read_jsonl
from rdepth.run.checkpoint import list_checkpoints
from rdepth.train import timefit
from rdepth.train.config import TrainConfig
from rdepth.train.optim import lr_at

STEPS = ("--max-steps", "20", "--eval-every", "10", "--checkpoint-every", "10", "--seed", "3")


def test_fit_points_and_first_mark():
    assert timefit.fit_points(100) == [10, 30, 50, 70]
    assert timefit.first_mark(100) == 5
    assert timefit.fit_points(20) == [2, 6, 10, 14]
    assert timefit.first_mark(20) == 1
    assert timefit.fit_points(5) == [2, 4]  # 0.1 x 5 rounds to 0: no fit before step 2
    assert timefit.fit_points(2) == [] and timefit.first_mark(2) is None


def test_fitted_max_steps_only_shortens():
    # 40 s left at 2 s a step: 20 more steps after step 10.
    assert timefit.fitted_max_steps(10, 60.0, 2.0, 100.0, 100) == 30
    assert timefit.fitted_max_steps(10, 60.0, 2.0, 1000.0, 100) == 100  # room to spare: the plan stands
    assert timefit.fitted_max_steps(10, 120.0, 2.0, 100.0, 100) == 11  # already over: one more step
    assert timefit.fitted_max_steps(10, 60.0, 0.0, 100.0, 100) == 100  # no timing: unchanged


def test_refit_scales_the_cadences_on_the_first_fit_only():
    config = TrainConfig(max_steps=400, eval_every=100, checkpoint_every=100, milestone_every=200)
    first = timefit.refit(config, 300, scale_cadences=True)
    assert (first.max_steps, first.eval_every, first.checkpoint_every) == (300, 75, 75)
    assert first.milestone_every is None  # 200 is no multiple of 75: back to the default
    later = timefit.refit(config, 300, scale_cadences=False)
    assert (later.max_steps, later.eval_every, later.checkpoint_every, later.milestone_every) == (300, 100, 100, 200)


@pytest.mark.parametrize("flags, fragment", [
    (("--time-limit", "0"), "time_limit must be a finite number > 0"),
    (("--time-limit", "nan"), "time_limit must be a finite number"),
    (("--time-limit", "5", "--stop-at", "3"), "time_limit and stop_at"),
])
def test_bad_time_limits_are_one_line_errors(wiki_small, tmp_path, capsys, flags, fragment):
    assert main(train_argv(wiki_small, tmp_path / "run", *STEPS, *flags)) != 0
    assert fragment in error_line(capsys)
    assert not (tmp_path / "run").exists()


def _weights(run):
    return load_file(str(list_checkpoints(run)[-1] / "model.safetensors"))


def test_a_limit_with_room_to_spare_changes_nothing(wiki_small, tmp_path):
    plain, limited = tmp_path / "plain", tmp_path / "limited"
    assert main(train_argv(wiki_small, plain, *STEPS)) == 0
    assert main(train_argv(wiki_small, limited, *STEPS, "--time-limit", "100000")) == 0
    a, b = _weights(plain), _weights(limited)
    assert all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((limited / "summary.json").read_text())
    assert summary["step"] == summary["max_steps"] == 20 and "schedule_fits" not in summary


def test_an_overrun_ends_the_schedule_at_the_first_fit(wiki_small, tmp_path):
    run = tmp_path / "run"
    assert main(train_argv(wiki_small, run, *STEPS, "--time-limit", "1e-6")) == 0
    summary = json.loads((run / "summary.json").read_text())
    # Timed at step 2 (the first fit point), already over the limit: one more step.
    assert summary["step"] == summary["max_steps"] == 3
    (fit,) = summary["schedule_fits"]
    assert fit["step"] == 2 and fit["max_steps"] == [20, 3] and fit["checkpoint_every"] == [10, 2]
    assert [c.name for c in list_checkpoints(run)] == ["step_000003"]
    # config.json keeps the settings asked for; the checkpoint records the schedule it followed.
    assert json.loads((run / "config.json").read_text())["train"]["max_steps"] == 20
    state = json.loads((list_checkpoints(run)[-1] / "state.json").read_text())
    assert state["train_config"]["max_steps"] == 3 and state["schedule_fits"] == summary["schedule_fits"]
    # Steps before the fit follow the planned schedule, the step after it the fitted one.
    asked = TrainConfig.from_dict(json.loads((run / "config.json").read_text())["train"])
    fitted = TrainConfig.from_dict(state["train_config"])
    lrs = {r["step"]: r["lr"] for r in read_jsonl(run / "metrics.jsonl") if "lr" in r}
    assert lrs[1] == lr_at(0, asked) and lrs[2] == lr_at(1, asked) and lrs[3] == lr_at(2, fitted)


def test_a_resumed_run_keeps_its_fitted_schedule(wiki_small, tmp_path, monkeypatch):
    # A fit to 12 steps, whatever the clock says: checkpoints at 6 and 12 (cadence 10 x 12/20).
    monkeypatch.setattr("rdepth.train.trainer.fitted_max_steps", lambda done, *rest: 12)
    straight, split = tmp_path / "straight", tmp_path / "split"
    for run in (straight, split):
        assert main(train_argv(wiki_small, run, *STEPS, "--time-limit", "50")) == 0
    assert [c.name for c in list_checkpoints(split)] == ["step_000006", "step_000012"]
    # Interrupted after step 6: the last checkpoint and the summary never written.
    shutil.rmtree(list_checkpoints(split)[-1])
    (split / "summary.json").unlink()
    assert main(["train", "--out", str(split), "--resume"]) == 0
    summary = json.loads((split / "summary.json").read_text())
    assert summary["step"] == summary["max_steps"] == 12
    a, b = _weights(straight), _weights(split)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_or_reuse_reuses_a_run_its_limit_ended(wiki_small, tmp_path, monkeypatch):
    from rdepth.config import ModelConfig
    from rdepth.train import launch
    from rdepth.train.resume import data_model_config_for

    run = tmp_path / "run"
    model = data_model_config_for(ModelConfig(n_layer=3, n_head=2, d_model=32, block_size=32, groups="1",
                                              mean_loops=3, backprop_depth=2), wiki_small)
    config = TrainConfig(data=str(wiki_small), out=str(run), max_steps=20, batch_size=4, eval_every=10,
                         eval_batches=1, checkpoint_every=10, warmup_steps=2, seed=3, threads=1, time_limit=1e-6)
    launch.train_or_reuse(model, config)
    assert json.loads((run / "summary.json").read_text())["step"] == 3

    def refuse(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(launch, "train", refuse)
    # A later invocation has another time limit (the budget left then): the finished run is reused.
    launch.train_or_reuse(model, TrainConfig(**{**config.to_dict(), "time_limit": 30.0}))
    with pytest.raises(RdepthError, match="other settings"):
        launch.train_or_reuse(model, TrainConfig(**{**config.to_dict(), "lr": 1e-3}))
