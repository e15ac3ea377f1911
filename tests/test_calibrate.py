"""Calibrated per-group exits: the choice on constructed tables, the replay's reading, the CLI round trip."""

from __future__ import annotations

import json

import pytest
import torch

from rdepth.calibrate.run import better_on_calibration, choose, read_through_rest, record_iterates, refine
from rdepth.cli.main import main
from rdepth.config import ModelConfig
from rdepth.exits.controller import controller_factory
from rdepth.model import RecurrentLM
from rdepth.model.noise import StateNoise


def rows(*entries):
    return [{"value": v, "steps": s, "loss": loss, "quality": -loss} for v, s, loss in entries]


def test_choose_takes_the_fewest_steps_within_the_loss_per_group():
    # group 0 is cheap to cut, group 1 is not: per group beats any shared value
    table = [rows((1, 8.0, 0.0), (2, 4.0, 0.001), (3, 2.0, 0.002)),
             rows((1, 8.0, 0.0), (2, 6.0, 0.006), (3, 3.0, 0.05))]
    best = choose(table, max_loss=0.005)
    assert best["values"] == [3, 1] and best["predicted_steps"] == 10.0
    assert best["predicted_loss"] == pytest.approx(0.002)
    shared = choose(table, max_loss=0.005, shared=True)
    assert shared["values"] == [1, 1] and shared["predicted_steps"] == 16.0
    # a step budget: the lowest loss within it
    within = choose(table, mean_steps=10.0)
    assert within["values"] == [3, 1] and within["predicted_loss"] == pytest.approx(0.002)
    assert choose(table, max_loss=-1.0) is None
    with pytest.raises(Exception):  # noqa: B017 (any refusal: the point is that it does not return a row)
        choose(table)


def test_refine_corrects_an_estimate_that_misses_on_the_real_run():
    """Groups interact: cutting both costs 0.003 more than the sum of their losses. The first choice
    misses the target on the real run; refinement takes the miss off the target and finds one that meets it."""
    table = [rows((1, 8.0, 0.0), (2, 4.0, 0.002), (3, 3.0, 0.001)),
             rows((1, 8.0, 0.0), (2, 5.0, 0.002))]

    def real(values):
        chosen = [next(r for r in rows_ if r["value"] == v) for rows_, v in zip(table, values, strict=False)]
        both = all(v != 1 for v in values)
        return {"loss": sum(r["loss"] for r in chosen) + (0.003 if both else 0.0),
                "steps": sum(r["steps"] for r in chosen)}

    limits = dict(max_loss=0.004, mean_steps=None)
    assert choose(table, **limits)["values"] == [3, 2]  # 8 steps, estimated 0.003, really 0.006
    refined = refine(table, limits, real, rounds=3)
    assert refined["values"] == [3, 1] and refined["realised"]["calibration"]["loss"] == pytest.approx(0.001)
    assert [h["values"] for h in refined["refinement"]] == [[3, 2], [3, 1]]
    assert refined["refinement"][1]["limit"] == pytest.approx(0.001)  # 0.004 minus the 0.003 missed
    # with no rounds the estimate is trusted, and the miss is what comes back
    trusted = refine(table, limits, real, rounds=0)
    assert trusted["values"] == [3, 2] and trusted["realised"]["calibration"]["loss"] == pytest.approx(0.006)
    # a step budget: refinement keeps the real steps within it
    within = refine(table, dict(max_loss=None, mean_steps=11.0), real, rounds=3)
    assert within["realised"]["calibration"]["steps"] <= 11.0


def test_the_real_calibration_run_decides_between_per_group_and_shared():
    def profile(loss, steps):
        return {"realised": {"calibration": {"loss": loss, "steps": steps}}}

    loss_target, step_target = dict(max_loss=0.01, mean_steps=None), dict(max_loss=None, mean_steps=5.0)
    assert better_on_calibration(profile(0.009, 5.0), profile(0.012, 4.0), loss_target)  # only one meets it
    assert better_on_calibration(profile(0.009, 4.5), profile(0.002, 5.0), loss_target)  # fewer steps
    assert not better_on_calibration(profile(0.009, 5.0), profile(0.002, 5.0), loss_target)  # tie: less loss
    assert better_on_calibration(profile(0.010, 4.8), profile(0.014, 4.7), step_target)  # less loss
    assert better_on_calibration(profile(0.030, 4.9), profile(0.001, 5.2), step_target)  # only one within


def test_reading_the_recorded_full_budget_states_reproduces_the_model():
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(n_layer=5, n_head=2, d_model=16, block_size=12, vocab_size=50, groups="1|2-3",
                                    mean_loops=2.0, backprop_depth=2, tokenizer="bpe:50")).eval()
    windows = torch.randint(0, 50, (5, 13))
    k_max = (3, 2)
    iterates, logits = record_iterates(model, windows, k_max, batch_size=2, seed=7)
    assert [tuple(s.shape) for s in iterates] == [(4, 60, 16), (3, 60, 16)]
    with torch.no_grad():
        direct = torch.cat([model(windows[i:i + 2, :-1], loop_counts=list(k_max),
                                  noise=StateNoise.consecutive(7, i, windows[i:i + 2].shape[0])).logits
                            for i in range(0, 5, 2)])
    assert torch.equal(logits, direct)
    for group in (0, 1):  # the final iterate read through the rest is the model's own output
        read = read_through_rest(model, group, iterates[group][-1].view(5, 12, 16), k_max, batch_size=2, seed=7)
        torch.testing.assert_close(read, logits, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    data, run = root / "data", root / "run"
    params = json.dumps({"chase": {"nodes": 8, "queries": 4, "ordered": True}})
    assert main(["prepare", "--corpus", "task:chase", "--out", str(data), "--train-difficulties", "1,3",
                 "--train-tokens", "20000", "--val-tokens", "2000", "--heldout-problems", "40", "--block-size", "20",
                 "--task-params", params]) == 0
    assert main(["train", "--data", str(data), "--out", str(run), "--n-layer", "3", "--n-head", "2", "--d-model", "16",
                 "--block-size", "20", "--groups", "1|2", "--mean-loops", "2", "--backprop-depth", "2",
                 "--max-steps", "3", "--batch-size", "4", "--eval-batches", "1"]) == 0
    return data, run


def test_calibrate_writes_a_profile_that_eval_takes(task_run, tmp_path, capsys):
    data, run = task_run
    profile = tmp_path / "profile.json"
    argv = ["calibrate", "--checkpoint", str(run), "--data", str(data), "--policy", "step_norm",
            "--max-quality-loss", "0.05", "--values", "1e-3,1e-1,10", "--k-max", "3", "--windows", "10",
            "--validation-windows", "10", "--out", str(profile)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "per-group profile" in printed and "validation" in printed
    saved = json.loads(profile.read_text())
    assert saved["kind"] == "rdepth-exit-profile" and len(saved["values"]) == 2 and saved["k_max"] == [3, 3]
    assert saved["quality"] == "accuracy" and len(saved["candidates"]) == 2
    realised = saved["calibrated"]["realised"]["validation"]
    assert 0 < realised["steps"] <= 6 and realised["full_budget"]["steps"] == pytest.approx(6.0)

    assert main(["eval", "--checkpoint", str(run), "--data", str(data), "--exit-profile", str(profile)]) == 0
    assert "accuracy % (profile / full)" in capsys.readouterr().out
    assert main(argv) == 2  # the profile exists: nothing is overwritten
    assert "exists" in capsys.readouterr().err


@pytest.mark.parametrize("argv,fragment", [
    (["--policy", "acceleration"], "exactly one of"),
    (["--max-quality-loss", "0.01", "--mean-steps", "3"], "exactly one of"),
    (["--max-quality-loss", "0.01", "--policy", "nope"], "nope"),
    (["--max-quality-loss", "2"], "max_quality_loss"),
])
def test_bad_calibrate_input_is_one_line(argv, fragment, tmp_path, capsys):
    assert main(["calibrate", "--checkpoint", "x", "--data", "x", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1


def test_a_profile_for_another_model_is_refused(task_run, tmp_path, capsys):
    data, run = task_run
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"kind": "rdepth-exit-profile", "format": 1, "policy": "step_norm",
                                 "parameter": "tau", "values": [0.1], "k_max": [3], "options": {}}))
    assert main(["eval", "--checkpoint", str(run), "--data", str(data), "--exit-profile", str(wrong)]) == 2
    assert "1 group value(s) for a model with 2 group(s)" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(run), "--data", str(data), "--exit-profile", str(wrong),
                 "--loops", "2"]) == 2


def test_generate_takes_a_profile_and_refuses_mixing_it_with_loops(tmp_path, capsys):
    assert main(["generate", "--checkpoint", "x", "--exit-profile", "p.json", "--loops", "2"]) == 2
    assert "--exit-profile replaces --loops" in capsys.readouterr().err


def test_export_takes_a_profile_as_per_group_thresholds(tmp_path):
    from rdepth.exitrun.profile import make_profile
    from rdepth.interop.config import ExportConfig

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(make_profile("kl", [1e-3, 1e-2], [5, 6], {"direction": "new_old"})))
    spec = ExportConfig(checkpoint="x", out="y", exit_profile=str(path)).exit_spec()
    assert spec == {"name": "kl", "tau": [1e-3, 1e-2], "k_max": [5, 6], "direction": "new_old"}
    options = dict(spec)
    controller = controller_factory(options.pop("name"), options.pop("tau"), options.pop("k_max"), None, options)()
    assert [(controller.policy(g).tau, controller.policy(g).k_max) for g in (0, 1)] == [(1e-3, 5), (1e-2, 6)]
    with pytest.raises(Exception, match="not both"):
        ExportConfig(checkpoint="x", out="y", exit_profile=str(path), exit_policy="kl")
