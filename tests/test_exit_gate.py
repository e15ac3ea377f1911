"""The learned exit gate on disk and from the command line: ``rdepth gate`` trains and saves it beside the
checkpoint, ``--policies learned`` reads it; a run without a gate, a gate trained for other weights or
another model config, a damaged gate and a threshold out of range are one-line errors (exit 2)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rdepth.calibrate.gate import fit_head
from rdepth.cli.main import main
from rdepth.exitrun.gate_file import GATE_FILE, load_gate, save_gate
from rdepth.exits.gate import random_gate
from rdepth.run.checkpoint import resolve_checkpoint, run_identity


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
    """A tiny task run (two groups) with a gate trained by the command line."""
    root = tmp_path_factory.mktemp("gate")
    data, run = root / "data", root / "run"
    params = json.dumps({"chase": {"nodes": 8, "queries": 4, "ordered": True}})
    assert main(["prepare", "--corpus", "task:chase", "--out", str(data), "--train-difficulties", "1,3",
                 "--train-tokens", "20000", "--val-tokens", "3000", "--heldout-problems", "16", "--block-size", "20",
                 "--task-params", params]) == 0
    assert main(["train", "--data", str(data), "--out", str(run), "--n-layer", "3", "--n-head", "2", "--d-model", "16",
                 "--block-size", "20", "--groups", "1|2", "--mean-loops", "2", "--backprop-depth", "2",
                 "--max-steps", "3", "--batch-size", "4", "--eval-batches", "1"]) == 0
    return data, run


def sweep_argv(run, data, out, *flags):
    return ["sweep", "--checkpoint", str(run), "--data", str(data), "--out", str(out), "--policies", "learned",
            "--k-max", "3", "--no-timing", "--task-windows", "4", "--batch-size", "4", "--no-progress", *flags]


def copy_run(run, tmp_path):
    """A copy of ``run`` (its checkpoint folder too) to break in one way."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    return copy, resolve_checkpoint(copy)


@pytest.fixture(scope="module")
def trained(task_run):
    data, run = task_run
    assert main(["gate", "--checkpoint", str(run), "--data", str(data), "--windows", "12", "--k-max", "3",
                 "--steps", "60", "--no-progress"]) == 0
    return data, run


def test_gate_command_saves_a_gate_tied_to_the_weights_and_the_sweep_runs_it(trained, tmp_path, capsys):
    data, run = trained
    path = resolve_checkpoint(run) / GATE_FILE
    assert path.is_file()
    gate = load_gate(run)
    assert (gate.n_groups, gate.d_model) == (2, 16)
    assert gate.metadata["weights_sha256"] == run_identity(resolve_checkpoint(run))["weights_sha256"]
    report = json.loads(gate.metadata["training"])
    assert report["k_max"] == [3, 3] and report["positions"] == "all" and len(report["groups"]) == 2
    for group in report["groups"]:
        assert 1 <= group["mean_target_step"] <= 3 and group["kept_out"]["rows"] > 0
    capsys.readouterr()
    out = tmp_path / "sweep"
    assert main(sweep_argv(run, data, out, "--grid", "learned=0.05,0.5,1")) == 0
    result = json.loads((out / "task_sweep.json").read_text())
    points = result["difficulties"][0]["points"]
    assert [p["label"] for p in points] == ["learned tau=0.05", "learned tau=0.5", "learned tau=1"]
    # tau 1 stops every token whose gate gives p > 0, i.e. every token, at step 1 in each group
    assert points[-1]["steps"] == pytest.approx(2.0)
    assert all(1.0 <= p["steps"] <= 6.0 for p in points)


def test_a_run_without_a_gate_is_a_one_line_error(trained, tmp_path, capsys):
    data, run = trained
    copy, checkpoint = copy_run(run, tmp_path)
    (checkpoint / GATE_FILE).unlink()
    capsys.readouterr()
    assert main(sweep_argv(copy, data, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "has no trained exit gate" in err and "rdepth gate" in err and len(err.strip().splitlines()) == 1


def test_a_gate_trained_for_other_weights_is_a_one_line_error(trained, tmp_path, capsys):
    data, run = trained
    copy, checkpoint = copy_run(run, tmp_path)
    weights = load_file(str(checkpoint / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(checkpoint / "model.safetensors"))
    capsys.readouterr()
    assert main(sweep_argv(copy, data, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "was trained for other weights" in err and len(err.strip().splitlines()) == 1


def test_a_gate_trained_for_another_model_config_is_a_one_line_error(trained, tmp_path, capsys):
    data, run = trained
    copy, checkpoint = copy_run(run, tmp_path)
    config = json.loads((checkpoint / "config.json").read_text())
    config["mean_loops"] = 3.0  # the same weights' shapes, another model
    (checkpoint / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(sweep_argv(copy, data, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "was trained for another model" in err and len(err.strip().splitlines()) == 1


def test_a_damaged_gate_is_a_one_line_error(trained, tmp_path, capsys):
    data, run = trained
    copy, checkpoint = copy_run(run, tmp_path)
    gate = checkpoint / GATE_FILE
    gate.write_bytes(gate.read_bytes()[:40])
    capsys.readouterr()
    assert main(sweep_argv(copy, data, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "is corrupt or truncated" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("value", ["1.5", "0"])
def test_a_threshold_out_of_range_is_a_one_line_error(trained, tmp_path, capsys, value):
    data, run = trained
    capsys.readouterr()
    assert main(sweep_argv(run, data, tmp_path / "out", "--grid", f"learned=0.5,{value}")) == 2
    err = capsys.readouterr().err
    assert ("learned takes tau in (0, 1]" in err or "positive finite" in err) and len(err.strip().splitlines()) == 1


def test_save_refuses_a_gate_of_another_shape(trained):
    _, run = trained
    with pytest.raises(Exception, match="do not fit the model"):
        save_gate(random_gate(1, 16), run)


def test_fit_head_separates_a_separable_set():
    """A constructed set: the label is whether the first feature is positive; the probe finds it."""
    features = torch.randn(400, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    labels = features[:, 0] > 0
    weight, bias, loss = fit_head(features, labels, steps=300, lr=0.1)
    assert (((features @ weight + bias) > 0) == labels).float().mean() > 0.97
    assert loss < 0.2 and weight[0] > 3 * weight[1:].abs().max()


def test_gate_help_lists_its_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["gate", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--checkpoint" in out and "--validation-share" in out and "exit_gate.safetensors" in out


def test_generate_exit_learned_reads_the_gate_and_refuses_a_run_without_one(trained, tmp_path, capsys):
    """``rdepth generate --exit learned`` (the one decoder) takes the run's gate; tau 1 stops every token at
    step 1 of each group, which is the fixed budget of one loop."""
    _, run = trained
    argv = ["generate", "--checkpoint", str(run), "--prompt", "a ? b", "--max-new-tokens", "4", "--temperature", "0",
            "--device", "cpu"]
    capsys.readouterr()
    assert main(argv + ["--exit", "learned", "--tau", "1", "--k-max", "3"]) == 0
    learned = capsys.readouterr().out
    assert main(argv + ["--loops", "1"]) == 0
    assert learned == capsys.readouterr().out
    copy, checkpoint = copy_run(run, tmp_path)
    (checkpoint / GATE_FILE).unlink()
    argv[2] = str(copy)
    assert main(argv + ["--exit", "learned", "--tau", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "has no trained exit gate" in err and len(err.strip().splitlines()) == 1


def test_positions_answers_trains_on_the_answer_tokens_only_and_needs_task_data(trained, tmp_path, capsys):
    data, run = trained
    copy, _ = copy_run(run, tmp_path)
    assert main(["gate", "--checkpoint", str(copy), "--data", str(data), "--windows", "12", "--k-max", "3",
                 "--steps", "20", "--positions", "answers", "--no-progress", "--overwrite"]) == 0
    answers = json.loads(load_gate(copy).metadata["training"])
    every = json.loads(load_gate(run).metadata["training"])
    assert every["positions"] == "all" and answers["positions"] == "masked"
    assert every["groups"][0]["fit"]["rows"] > answers["groups"][0]["fit"]["rows"]
    text = tmp_path / "text"
    text.mkdir()
    (text / "manifest.json").write_text(json.dumps({"format_version": 1}))
    capsys.readouterr()
    assert main(["gate", "--checkpoint", str(run), "--data", str(text), "--positions", "answers"]) == 2
    err = capsys.readouterr().err
    assert "--positions answers needs task data" in err and len(err.strip().splitlines()) == 1


def test_calibrate_chooses_a_learned_threshold_per_group(trained, tmp_path, capsys):
    """``rdepth calibrate --policy learned`` reads the run's gate, tries taus in (0, 1] only, and writes a
    profile that eval applies."""
    data, run = trained
    profile = tmp_path / "learned.json"
    assert main(["calibrate", "--checkpoint", str(run), "--data", str(data), "--policy", "learned",
                 "--max-quality-loss", "0.05", "--k-max", "3", "--windows", "10", "--validation-windows", "10",
                 "--out", str(profile)]) == 0
    saved = json.loads(profile.read_text())
    assert saved["policy"] == "learned" and saved["options"] == {"gate": str(run)} and len(saved["values"]) == 2
    assert all(0 < value <= 1 for value in saved["values"])
    assert max(row["value"] for row in saved["candidates"][0]) == 1.0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--data", str(data), "--exit-profile", str(profile)]) == 0


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def other_model(trained, tmp_path_factory):
    """A run of the same shape with other weights and its own gate (issue 55: another model's gate)."""
    data, run = trained
    copy, checkpoint = copy_run(run, tmp_path_factory.mktemp("other"))
    weights = load_file(str(checkpoint / "model.safetensors"))
    weights = {name: tensor + 1e-2 for name, tensor in weights.items()}
    save_file(weights, str(checkpoint / "model.safetensors"))
    assert main(["gate", "--checkpoint", str(copy), "--data", str(data), "--windows", "12", "--k-max", "3",
                 "--steps", "30", "--no-progress", "--overwrite"]) == 0
    return copy


def test_another_models_gate_is_refused_wherever_it_is_named_from(trained, other_model, tmp_path, capsys):
    """Issue 55: ``generate --checkpoint A --exit learned --exit-options gate=B`` ran B's gate on A's weights,
    exit 0; a copy of A's own gate (the same weights) is still taken."""
    _, run = trained
    argv = ["generate", "--checkpoint", str(run), "--prompt", "a ? b", "--max-new-tokens", "2", "--temperature", "0",
            "--device", "cpu", "--exit", "learned", "--tau", "0.5", "--k-max", "3"]
    capsys.readouterr()
    assert main(argv + ["--exit-options", f"gate={other_model}"]) == 2
    assert "was trained for the model of" in one_line_error(capsys)
    twin, _ = copy_run(run, tmp_path)
    assert main(argv + ["--exit-options", f"gate={twin}"]) == 0
    from rdepth.serve.config import ServeConfig
    from rdepth.serve.server import served_model

    config = ServeConfig(checkpoint=str(run), exit="learned", tau=0.5, exit_options=f"gate={other_model}")
    with pytest.raises(Exception, match="was trained for the model of"):
        served_model(config)


def test_a_gate_with_a_flipped_byte_is_refused(trained, tmp_path, capsys):
    data, run = trained
    copy, checkpoint = copy_run(run, tmp_path)
    gate = checkpoint / GATE_FILE
    raw = bytearray(gate.read_bytes())
    raw[-3] ^= 0x10  # inside the bias: a finite float still, another value
    gate.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(sweep_argv(copy, data, tmp_path / "out")) == 2
    assert "SHA-256 differs" in one_line_error(capsys)


def test_gate_refuses_to_replace_a_gate_without_overwrite_and_a_profile_refuses_a_new_gate(trained, tmp_path, capsys):
    """Issue 55: ``rdepth gate`` replaced a gate silently and a learned profile then ran the new one."""
    data, run = trained
    copy, checkpoint = copy_run(run, tmp_path)
    before = (checkpoint / GATE_FILE).read_bytes()
    gate_argv = ["gate", "--checkpoint", str(copy), "--data", str(data), "--windows", "12", "--k-max", "3",
                 "--steps", "25", "--no-progress"]
    capsys.readouterr()
    assert main(gate_argv) == 2
    assert "--overwrite" in one_line_error(capsys) and (checkpoint / GATE_FILE).read_bytes() == before
    profile = tmp_path / "learned.json"
    assert main(["calibrate", "--checkpoint", str(copy), "--data", str(data), "--policy", "learned",
                 "--max-quality-loss", "0.05", "--k-max", "3", "--windows", "10", "--validation-windows", "10",
                 "--out", str(profile)]) == 0
    assert json.loads(profile.read_text())["gate_sha256"] == load_gate(copy).metadata["tensors_sha256"]
    eval_argv = ["eval", "--checkpoint", str(copy), "--data", str(data), "--exit-profile", str(profile)]
    assert main(eval_argv) == 0
    assert main(gate_argv + ["--overwrite"]) == 0
    assert (checkpoint / GATE_FILE).read_bytes() != before
    capsys.readouterr()
    for force in ([], ["--force-profile"]):
        assert main(eval_argv + force) == 2
        assert "calibrated with another exit gate" in one_line_error(capsys)


def test_the_next_gate_removes_an_interrupted_gates_temporary_file(trained, tmp_path, capsys):
    """Issue 55: a killed gate left ``.exit_gate.safetensors.XXXXXXXX.tmp`` beside the weights for good."""
    from rdepth.run.checkpoint import clean_debris

    data, run = trained
    copy, checkpoint = copy_run(run, tmp_path)
    debris = checkpoint / ".exit_gate.safetensors.abcd1234.tmp"
    debris.write_bytes(b"half a gate")
    assert main(["gate", "--checkpoint", str(copy), "--data", str(data), "--windows", "12", "--k-max", "3",
                 "--steps", "5", "--no-progress", "--overwrite"]) == 0
    assert not debris.exists()
    debris.write_bytes(b"half a gate")  # training's start (clean_debris) removes one as well
    assert clean_debris(copy) == [f"{checkpoint.name}/{debris.name}"] and not debris.exists()
