"""Reliability, round 3 (issue 31): what commands read is checked (shards, weights, exit profiles and
whose run they belong to), calibrate's output is locked and never overwritten, and re-runs into a
finished folder replace it whole (a kill leaves the old result or the new one, never a mix)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from reliability_helpers import error_line, train_argv  # noqa: E402

from rdepth.cli.main import main
from rdepth.errors import RdepthError
from rdepth.io import JOURNAL_NAME, STAGING_NAME, atomic_path, exclusive, staged_output, write_json

CALIBRATE = ["--max-quality-loss", "0.5", "--windows", "4", "--validation-windows", "4", "--threads", "1"]


@pytest.fixture(scope="module")
def runs(wiki_small, tmp_path_factory):
    """Two 3-step runs of the same shape (seeds 0 and 1) and a profile calibrated on the first."""
    root = tmp_path_factory.mktemp("rel3out")
    for seed in (0, 1):
        assert main(train_argv(wiki_small, root / f"run{seed}", "--max-steps", "3", "--seed", str(seed))) == 0
    profile = root / "profile.json"
    assert main(["calibrate", "--checkpoint", str(root / "run0"), "--data", str(wiki_small), "--out", str(profile),
                 *CALIBRATE]) == 0
    return root


@pytest.fixture
def run_copy(runs, tmp_path):
    return Path(shutil.copytree(runs / "run0", tmp_path / "run"))


def run_cli(argv) -> int:
    """``rdepth ARGV``'s exit status, parse errors (argparse exits) included."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


def eval_argv(run, data, *extra):
    return ["eval", "--checkpoint", str(run), "--data", str(data), "--threads", "1", "--max-batches", "1",
            "--no-progress", *extra]


# ---------------------------------------------------------------- what is read is checked
def test_eval_verifies_the_val_shard(run_copy, wiki_small, tmp_path, capsys):
    data = Path(shutil.copytree(wiki_small, tmp_path / "data"))
    shard = bytearray((data / "val.bin").read_bytes())
    shard[100] ^= 1  # an id still in range: only the hash can tell
    (data / "val.bin").write_bytes(bytes(shard))
    assert main(eval_argv(run_copy, data)) == 2
    assert "val.bin fails its SHA-256 check" in error_line(capsys)


@pytest.mark.parametrize("damage, fragment", [
    (lambda w: {k: v.to(torch.int32) for k, v in w.items()}, "not a floating-point type"),
    (lambda w: {k: torch.full_like(v, float("nan")) for k, v in w.items()}, "NaN or infinite"),
])
def test_weights_are_checked_for_dtype_and_finiteness(run_copy, wiki_small, capsys, damage, fragment):
    from safetensors.torch import load_file, save_file

    path = run_copy / "checkpoints" / "step_000003" / "model.safetensors"
    save_file(damage(load_file(str(path))), str(path))
    assert main(eval_argv(run_copy, wiki_small)) == 2
    assert fragment in error_line(capsys)


def test_profile_k_max_is_bounded_by_the_loop_bound(runs, run_copy, wiki_small, tmp_path, capsys):
    profile = json.loads((runs / "profile.json").read_text())
    profile["k_max"] = [10**9]
    (tmp_path / "p.json").write_text(json.dumps(profile))
    assert main(eval_argv(run_copy, wiki_small, "--exit-profile", str(tmp_path / "p.json"))) == 2
    assert "k_max must be integers in 1..1024" in error_line(capsys)


def test_profile_of_another_run_is_refused_unless_forced(runs, wiki_small, capsys):
    profile = str(runs / "profile.json")
    assert main(eval_argv(runs / "run0", wiki_small, "--exit-profile", profile)) == 0
    capsys.readouterr()
    assert main(eval_argv(runs / "run1", wiki_small, "--exit-profile", profile)) == 2
    line = error_line(capsys)
    assert "was made for other weights" in line and "same shape" in line and "--force-profile" in line
    assert main(eval_argv(runs / "run1", wiki_small, "--exit-profile", profile, "--force-profile")) == 0


def test_profile_without_identity_is_refused(runs, wiki_small, tmp_path, capsys):
    profile = json.loads((runs / "profile.json").read_text())
    del profile["run"]
    (tmp_path / "p.json").write_text(json.dumps(profile))
    assert main(eval_argv(runs / "run0", wiki_small, "--exit-profile", str(tmp_path / "p.json"))) == 2
    assert "records no run identity" in error_line(capsys)


def test_export_checks_the_profiles_run_identity(runs, tmp_path, capsys):
    """``rdepth export --exit-profile`` applies the same run-identity check as eval, generate and sweep."""
    profile = str(runs / "profile.json")
    spec = json.loads((runs / "profile.json").read_text())
    assert main(["export", "--checkpoint", str(runs / "run1"), "--out", str(tmp_path / "hf1"),
                 "--exit-profile", profile]) == 2
    line = error_line(capsys)
    assert "was made for other weights" in line and "--force-profile" in line
    assert not (tmp_path / "hf1").exists()
    assert main(["export", "--checkpoint", str(runs / "run1"), "--out", str(tmp_path / "hf1"),
                 "--exit-profile", profile, "--force-profile"]) == 0
    assert main(["export", "--checkpoint", str(runs / "run0"), "--out", str(tmp_path / "hf0"),
                 "--exit-profile", profile]) == 0
    exported = json.loads((tmp_path / "hf0" / "config.json").read_text())["exit_policy"]
    assert exported["name"] == spec["policy"] and exported["tau"] == spec["values"]
    assert exported["k_max"] == spec["k_max"]
    capsys.readouterr()
    del spec["run"]
    (tmp_path / "p.json").write_text(json.dumps(spec))
    assert main(["export", "--checkpoint", str(runs / "run0"), "--out", str(tmp_path / "hf2"),
                 "--exit-profile", str(tmp_path / "p.json")]) == 2
    assert "records no run identity" in error_line(capsys)


@pytest.mark.parametrize("command", ["eval", "generate", "sweep", "export"])
def test_force_profile_without_a_profile_is_refused(runs, wiki_small, tmp_path, capsys, command):
    argv = {"eval": eval_argv(runs / "run0", wiki_small),
            "generate": ["generate", "--checkpoint", str(runs / "run0"), "--threads", "1"],
            "sweep": ["sweep", "--checkpoint", str(runs / "run0"), "--data", str(wiki_small), "--out",
                      str(tmp_path / "s"), "--threads", "1"],
            "export": ["export", "--checkpoint", str(runs / "run0"), "--out", str(tmp_path / "hf")]}[command]
    assert run_cli([*argv, "--force-profile"]) == 2
    assert "--force-profile applies to --exit-profile" in error_line(capsys)
    assert not (tmp_path / "s").exists() and not (tmp_path / "hf").exists()


def test_profile_is_standard_json_with_the_run_identity(runs):
    text = (runs / "profile.json").read_text()
    assert "Infinity" not in text and "NaN" not in text
    from rdepth.data.shards import file_sha256

    recorded = json.loads(text)["run"]
    assert recorded["weights_sha256"] == file_sha256(runs / "run0" / "checkpoints" / "step_000003" /
                                                     "model.safetensors")


def test_strict_json_refuses_non_finite(tmp_path):
    with pytest.raises(RdepthError, match="not finite"):
        write_json(tmp_path / "p.json", {"mean_steps": float("inf")}, strict=True)
    assert not (tmp_path / "p.json").exists()
    with pytest.raises(RdepthError, match=r"groups\[1\]\.tau is not finite \(nan\)"):
        write_json(tmp_path / "p.json", {"groups": [{"tau": 0.1}, {"tau": np.float32("nan")}]}, strict=True)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- standard JSON everywhere
def standard_json(text: str):
    """Parse as a strict reader would: the tokens NaN, Infinity and -Infinity are not JSON."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_results_write_non_finite_numbers_as_null(tmp_path):
    """A result that is not a number (a diverged loss, an unreached threshold) is written as null, wherever
    it sits and whatever its type (Python, numpy or torch); finite numbers and everything else are kept."""
    result = {"ce": 800.0, "ppl": float("inf"), "curve": [1.5, float("-inf"), np.float32("nan")],
              "array": np.array([0.25, np.nan]), "tensor": torch.tensor([float("inf"), 2.0]),
              "steps": np.int64(7), "path": tmp_path, "nested": ({"v": float("nan")},), "none": None}
    write_json(tmp_path / "r.json", result)
    assert standard_json((tmp_path / "r.json").read_text()) == {
        "ce": 800.0, "ppl": None, "curve": [1.5, None, None], "array": [0.25, None], "tensor": [None, 2.0],
        "steps": 7, "path": str(tmp_path), "nested": [{"v": None}], "none": None}
    from rdepth.io import append_jsonl, read_jsonl

    append_jsonl(tmp_path / "m.jsonl", {"step": 1, "loss": float("nan"), "grad_norm": np.float64("inf")})
    (line,) = (tmp_path / "m.jsonl").read_text().splitlines()
    assert standard_json(line) == {"step": 1, "loss": None, "grad_norm": None}
    assert read_jsonl(tmp_path / "m.jsonl") == [{"step": 1, "loss": None, "grad_norm": None}]


def test_report_sections_keep_the_text_of_a_non_finite_cell(tmp_path):
    from rdepth.report.html import SECTIONS_DIR, Section, add_section

    page = add_section(tmp_path, Section("rows").table([{"policy": "kl", "steps": float("inf"),
                                                         "ratio": float("nan"), "ce": 3.25}]))
    saved = standard_json((tmp_path / SECTIONS_DIR / "rows.json").read_text())
    assert saved["blocks"][0]["rows"] == [{"policy": "kl", "steps": "∞", "ratio": "nan", "ce": 3.25}]
    html_text = page.read_text()
    assert "<td>∞</td>" in html_text or ">∞<" in html_text


def test_eval_json_is_standard_when_a_result_is_not_finite(runs, wiki_small, tmp_path, monkeypatch, capsys):
    """A model whose cross-entropy overflows exp(): ``ppl`` is null in ``--json``, never ``Infinity``."""
    import rdepth.run.eval_checkpoint as eval_checkpoint

    real = eval_checkpoint.evaluate

    def overflowing(*args, **kwargs):
        return {**real(*args, **kwargs), "ce": 800.0, "ppl": float("inf")}

    monkeypatch.setattr(eval_checkpoint, "evaluate", overflowing)
    assert main(eval_argv(runs / "run0", wiki_small, "--json", str(tmp_path / "e.json"))) == 0
    (result,) = standard_json((tmp_path / "e.json").read_text())["results"]
    assert result["ce"] == 800.0 and result["ppl"] is None


def test_every_json_a_run_writes_is_standard(runs, tmp_path):
    """Train, calibrate and export outputs parse under a strict reader (no writer bypasses the helper)."""
    assert main(["export", "--checkpoint", str(runs / "run0"), "--out", str(tmp_path / "hf"), "--exit-profile",
                 str(runs / "profile.json")]) == 0
    files = [p for root in (runs, tmp_path / "hf") for p in root.rglob("*") if p.suffix in (".json", ".jsonl")]
    assert len(files) >= 10
    for path in files:
        for line in (path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]):
            standard_json(line)


# ---------------------------------------------------------------- calibrate: flags and its output
@pytest.mark.parametrize("flags, fragment", [
    (["--mean-steps", "inf"], "mean_steps must be a number in (0, "),
    (["--mean-steps", "nan"], "mean_steps must be a number in (0, "),
    (["--max-quality-loss", "0.1", "--difficulty", "5"], "--difficulty chooses a held-out set of task data"),
    (["--max-quality-loss", "0.1", "--windows", "100000"], "ask for at most"),
])
def test_calibrate_refuses_flags_that_do_not_apply(runs, wiki_small, tmp_path, capsys, flags, fragment):
    out = tmp_path / "p.json"
    assert run_cli(["calibrate", "--checkpoint", str(runs / "run0"), "--data", str(wiki_small), "--out", str(out),
                 "--threads", "1", *flags]) == 2
    assert fragment in error_line(capsys)
    assert not out.exists()


def test_calibrate_refuses_an_existing_profile(runs, wiki_small, capsys):
    before = (runs / "profile.json").read_bytes()
    assert main(["calibrate", "--checkpoint", str(runs / "run0"), "--data", str(wiki_small), "--out",
                 str(runs / "profile.json"), *CALIBRATE]) == 2
    assert "exists" in error_line(capsys)
    assert (runs / "profile.json").read_bytes() == before


def test_exclusive_write_lets_one_of_two_writers_win(tmp_path):
    """The race of two calibrations: both passed the early check; the second put-in-place is refused."""
    path = tmp_path / "p.json"
    write_json(path, {"first": 1}, overwrite=False)
    with pytest.raises(RdepthError, match="exists"):
        write_json(path, {"second": 2}, overwrite=False)
    assert json.loads(path.read_text()) == {"first": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary file left


def test_calibrate_takes_the_trainers_lock(runs, wiki_small, tmp_path, capsys):
    run = Path(shutil.copytree(runs / "run0", tmp_path / "run"))
    with exclusive(run, "train"):  # a training of this run is going on
        pid = os.fork()
        if pid == 0:  # another process: the lock is per process
            import rdepth.io

            rdepth.io._HELD.clear()  # what this process holds is the parent's, not the child's
            import contextlib

            with open(tmp_path / "err.txt", "w") as err, contextlib.redirect_stderr(err):
                code = main(["calibrate", "--checkpoint", str(run), "--data", str(wiki_small), *CALIBRATE])
            os._exit(code)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 2
    assert "is in use by rdepth train" in (tmp_path / "err.txt").read_text()
    assert not list(run.glob("exit_profile_*.json"))


# ---------------------------------------------------------------- foreign folders, whole replacement
def test_sweep_refuses_a_foreign_folder_before_any_work(runs, wiki_small, tmp_path, capsys, monkeypatch):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "index.html").write_text("<p>my page</p>")
    (out / "sweep.json").write_text("my numbers")

    def no_work(*args, **kwargs):
        raise AssertionError("the sweep ran before the folder was checked")

    monkeypatch.setattr("rdepth.sweep.run.open_run", no_work)
    assert main(["sweep", "--checkpoint", str(runs / "run0"), "--data", str(wiki_small), "--out", str(out),
                 "--threads", "1"]) == 2
    assert "is not an rdepth report page" in error_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "sweep.json"]
    assert (out / "sweep.json").read_text() == "my numbers"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_staged_output_killed_before_commit_keeps_the_old_result(tmp_path):
    out = tmp_path / "out"
    with exclusive(out, "sweep"), staged_output(out) as staging:
        write_json(staging / "sweep.json", {"v": 1})
        (staging / "figures").mkdir()
        (staging / "figures" / "a.png").write_bytes(b"old")
    old = _snapshot(out)
    # a Ctrl-C or SIGTERM half way through the re-run
    with pytest.raises(KeyboardInterrupt), exclusive(out, "sweep"), staged_output(out) as staging:
        write_json(staging / "sweep.json", {"v": 2})
        raise KeyboardInterrupt
    assert _snapshot(out) == old
    # A SIGKILL leaves the staging folder and temporary files: the next command in the folder removes them.
    (out / STAGING_NAME).mkdir()
    (out / STAGING_NAME / "sweep.json").write_text('{"v": 3}')
    (out / ".sweep.json.abcd1234.tmp").write_text("half")
    (out / "figures" / ".a.png.abcd1234.tmp").write_text("half")
    with exclusive(out, "analyze"):
        pass
    assert _snapshot(out) == old and not (out / STAGING_NAME).exists()


def test_staged_output_killed_after_commit_is_finished_by_the_next_run(tmp_path):
    out = tmp_path / "out"
    with exclusive(out, "sweep"), staged_output(out) as staging:
        write_json(staging / "sweep.json", {"v": 1})
        (staging / "sweep.csv").write_text("old")
    # A kill after the journal was written and one file moved: the folder mixes old and new until ...
    staging = out / STAGING_NAME
    staging.mkdir()
    (staging / "sweep.csv").write_text("new")
    write_json(out / JOURNAL_NAME, {"files": ["sweep.csv", "sweep.json"]})
    write_json(out / "sweep.json", {"v": 2})  # moved before the kill
    with exclusive(out, "eval"):  # ... the next command that locks the folder rolls the swap forward
        pass
    assert json.loads((out / "sweep.json").read_text()) == {"v": 2}
    assert (out / "sweep.csv").read_text() == "new"
    assert sorted(p.name for p in out.iterdir()) == ["sweep.csv", "sweep.json"]


def test_analyze_rerun_replaces_whole_and_keeps_other_sections(runs, wiki_small, tmp_path, monkeypatch):
    out = tmp_path / "an"
    argv = ["analyze", "--checkpoints", str(runs / "run0"), "--data", str(wiki_small), "--out", str(out),
            "--threads", "1", "--no-progress"]
    assert main([*argv, "--sequences", "2", "--long-loops", "4"]) == 0
    old = _snapshot(out)
    assert "<title>rdepth report: an" in (out / "index.html").read_text()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the re-run dies while drawing, after its numbers were written

    monkeypatch.setattr("rdepth.geometry.plots.draw_all", killed)
    assert main([*argv, "--sequences", "3", "--long-loops", "5"]) == 130
    assert _snapshot(out) == old
    assert not list(out.rglob("*.tmp")) and not (out / STAGING_NAME).exists()


def test_checkpoint_files_have_ordinary_modes(runs):
    checkpoint = runs / "run0" / "checkpoints" / "step_000003"
    for path in checkpoint.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044, path.name


def test_atomic_path_leaves_nothing_on_error(tmp_path):
    with pytest.raises(ValueError), atomic_path(tmp_path / "x.json") as tmp:
        tmp.write_text("half")
        raise ValueError
    assert list(tmp_path.iterdir()) == []


def test_recovery_removes_only_rdepths_own_temporary_files(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "notes").mkdir()
    (out / "checkpoints" / ".latest.k2x9aqzz.tmp").write_text("step_000003")  # a resume killed mid-write
    (out / "notes" / ".draft.abcdefgh.tmp").write_text("someone's")  # not a folder rdepth writes
    (out / ".vimrc.tmp").write_text("someone's")  # not atomic_path's pattern
    with exclusive(out, "train"):
        pass
    assert not (out / "checkpoints" / ".latest.k2x9aqzz.tmp").exists()
    assert (out / "notes" / ".draft.abcdefgh.tmp").exists() and (out / ".vimrc.tmp").exists()
