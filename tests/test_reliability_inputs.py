"""Reliability, round 3 (issue 31): sizes a user or a file controls are checked before anything is
allocated, user text reaches tokenizers and matplotlib safely, flags that do not apply are errors,
and the files a run reads back are validated like user input. Each case: exit status 2 (or
RdepthError in-process) and one line naming the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from reliability_helpers import error_line, train_argv  # noqa: E402

from rdepth.cli.main import main
from rdepth.config import ModelConfig
from rdepth.errors import RdepthError


@pytest.fixture(scope="module")
def trained(wiki_small, tmp_path_factory):
    run = tmp_path_factory.mktemp("rel3") / "run"
    assert main(train_argv(wiki_small, run, "--max-steps", "3")) == 0
    return run


@pytest.fixture
def run_copy(trained, tmp_path):
    return Path(shutil.copytree(trained, tmp_path / "run"))


# ---------------------------------------------------------------- 1. sizes checked before allocation
@pytest.mark.parametrize("field, value", [("d_model", 1_000_000), ("n_layer", 1000)])
def test_huge_checkpoint_config_is_refused_before_allocation(run_copy, wiki_small, capsys, field, value):
    checkpoint = run_copy / "checkpoints" / "step_000003"
    config = json.loads((checkpoint / "config.json").read_text())
    config[field] = value
    if field == "n_layer":
        config["d_model"] = 65536  # 1000 layers of 65536 wide: ~200 TB of weights
        config["n_head"] = 2
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert main(["eval", "--checkpoint", str(run_copy), "--data", str(wiki_small), "--threads", "1"]) == 2
    line = error_line(capsys)
    assert f"{field}={value}" in line and "GiB" in line and "more than this machine's" in line


def test_layer_count_has_a_stated_maximum():
    with pytest.raises(RdepthError, match="n_layer must be <= 1024"):
        ModelConfig(n_layer=10**6, n_head=1, d_model=1, groups="", vocab_size=2)


def test_allocator_runtime_error_is_one_line(monkeypatch, capsys, tmp_path):
    def out_of_memory(args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 4000000000000 bytes.")

    monkeypatch.setattr("rdepth.cli.eval.run", out_of_memory)
    assert main(["eval", "--checkpoint", str(tmp_path), "--data", str(tmp_path)]) == 2
    assert "out of memory" in error_line(capsys)


def test_other_runtime_errors_still_raise(monkeypatch):
    def bug(args):
        raise RuntimeError("a real bug")

    monkeypatch.setattr("rdepth.cli.eval.run", bug)
    with pytest.raises(RuntimeError, match="a real bug"):
        main(["eval", "--checkpoint", "x", "--data", "y"])


def test_generate_samples_bound(run_copy, capsys):
    assert main(["generate", "--checkpoint", str(run_copy), "--samples", "100000", "--threads", "1"]) == 2
    assert "samples must be an integer in [1, 1024]" in error_line(capsys)


def test_task_train_tokens_have_a_stated_maximum(tmp_path, capsys):
    argv = ["prepare", "--corpus", "task:chase", "--out", str(tmp_path / "t"), "--train-tokens", str(10**12)]
    assert main(argv) == 2
    assert "train_tokens must be an integer in [129, 1073741824]" in error_line(capsys)
    assert not (tmp_path / "t").exists()


def test_task_data_needs_the_disk_space(tmp_path, capsys, monkeypatch):
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    assert main(["prepare", "--corpus", "task:chase", "--out", str(tmp_path / "t")]) == 2
    assert "GiB free on the disk" in error_line(capsys)


# ---------------------------------------------------------------- 2. user text
def test_non_utf8_prompt_names_the_byte_offset(run_copy, capsys):
    prompt = b"ab\xff\xfecd".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    assert main(["generate", "--checkpoint", str(run_copy), "--prompt", prompt, "--threads", "1"]) == 2
    assert "prompt is not valid UTF-8 at byte offset 2 (0xff)" in error_line(capsys)


def test_non_utf8_prompt_in_the_library_names_the_byte_offset(run_copy):
    from rdepth.run.config import GenerateConfig

    with pytest.raises(RdepthError, match="prompt is not valid UTF-8 at byte offset 1"):
        GenerateConfig(checkpoint=str(run_copy), prompt=b"a\xc3(".decode("utf-8", "surrogateescape"))


def test_user_text_is_never_mathtext(tmp_path):
    """The folder-name label of the campaign: an unbalanced '$' in a label, a title and a legend."""
    from rdepth.report.figures import pyplot, save_figure

    plt = pyplot()
    name = r"x$\frac{$"
    figure, axis = plt.subplots()
    axis.plot([0, 1], [0, 1], label=name)
    axis.set_title(name)
    axis.set_xlabel(name)
    axis.legend()
    paths = save_figure(figure, tmp_path, "fig")
    assert paths["png"].stat().st_size > 0
    figure, axis = plt.subplots()  # a formula meant as one still renders as one
    axis.set_ylabel(r"$\cos\angle(\Delta^{(k)}, \Delta^{(k-1)})$", parse_math=True)
    assert axis.yaxis.label.get_parse_math()
    save_figure(figure, tmp_path, "formula")


@pytest.mark.parametrize("spec", ["task:chase*inf+assign", "task:chase*nan", "task:chase*1e308+assign*1e308",
                                  "task:chase*-1"])
def test_task_mixture_weights_finite_and_positive(spec, tmp_path, capsys):
    assert main(["prepare", "--corpus", spec, "--out", str(tmp_path / "t")]) == 2
    assert "must be a positive finite number" in error_line(capsys)


def test_as_mixture_refuses_infinite_weights():
    from rdepth.tasks.registry import get_task
    from rdepth.tasks.stream import as_mixture

    with pytest.raises(RdepthError, match="positive finite weight"):
        as_mixture([(get_task("chase"), float("inf"))])


# ---------------------------------------------------------------- 3. flags that do not apply
@pytest.mark.parametrize("flag, value", [("--corpus", "notes.txt"), ("--tokenizer", "foo")])
def test_demo_text_flags_in_task_mode_are_errors(flag, value, tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "d"), flag, value]) == 2
    assert f"{flag} applies to --mode text only" in error_line(capsys)
    assert not (tmp_path / "d").exists()


def test_demo_text_mode_defaults_unchanged():
    from rdepth.demo.run import DemoConfig

    config = DemoConfig(mode="text")
    assert (config.corpus, config.tokenizer, config.sweep_sequences) == ("wiki", "bpe:4096", 8)
    assert config.task is None and config.baselines is None  # task mode's fields: not used, recorded as null
    task = DemoConfig()
    assert (task.task, task.train_difficulties, task.train_tokens, task.baselines) == ("chase", (1, 8), 5_000_000,
                                                                                       ("no_loop",))
    assert task.preset == "task_loop"  # issue 38: the loop is the whole model
    assert task.loop_budgets == (1, 2, 3, 4, 6, 8, 12, 16, 32) and task.sweep_sequences is None


@pytest.mark.parametrize("mode, flag, value", [
    ("text", "--task", "chase"), ("text", "--train-difficulties", "1,8"), ("text", "--baselines", "deep"),
    ("text", "--task-params", "{not json"), ("text", "--train-tokens", "4000"), ("text", "--loop-budgets", "1,2"),
    ("text", "--curriculum-steps", "5"), ("task", "--sweep-sequences", "4"), ("task", "--max-documents", "10"),
])
def test_demo_flags_of_the_other_mode_are_errors(mode, flag, value, tmp_path, capsys):
    """Issue 43: these were accepted, ignored and written into demo.json as if used."""
    assert main(["demo", "--mode", mode, "--out", str(tmp_path / "d"), flag, value]) == 2
    other = "task" if mode == "text" else "text"
    assert f"{flag} applies to --mode {other} only" in error_line(capsys)
    assert not (tmp_path / "d").exists()


def test_train_flags_that_contradict_are_errors(wiki_small, tmp_path, capsys):
    """--compile-mode with --no-compile, and loop counts for a model without loops, were silently ignored
    (the latter reported validation "at loops []")."""
    run = tmp_path / "run"
    assert main(train_argv(wiki_small, run, "--no-compile", "--compile-mode", "max-autotune-no-cudagraphs")) == 2
    assert "--compile-mode applies when compiling" in error_line(capsys)
    assert main(train_argv(wiki_small, run, "--no-compile", "--compile-scope", "step")) == 2
    assert "--compile-scope applies when compiling" in error_line(capsys)
    assert main(train_argv(wiki_small, run, "--groups", "", "--eval-loops", "4")) == 2
    assert "no recurrence groups" in error_line(capsys)
    assert not run.exists()


@pytest.mark.parametrize("flags", [["--tokenizer", "bpe:512"], ["--max-documents", "10", "--workers", "2"]])
def test_prepare_text_flags_with_a_task_corpus_are_errors(flags, tmp_path, capsys):
    assert main(["prepare", "--corpus", "task:chase", "--out", str(tmp_path / "t"), *flags]) == 2
    line = error_line(capsys)
    assert flags[0] in line and "only to a text corpus" in line


# ---------------------------------------------------------------- 4. files a run reads back
@pytest.mark.parametrize("name, content, fragment", [
    ("config.json", "{not json", "run config"),
    ("config.json", "[1, 2]", "is not a JSON object"),
    ("summary.json", "[1, 2]", "is not a JSON object"),
    ("summary.json", '{"step": "3", "max_steps": 3}', "step must be an integer"),
])
def test_reuse_check_validates_the_runs_own_files(run_copy, name, content, fragment):
    from rdepth.train.config import TrainConfig
    from rdepth.train.launch import train_or_reuse

    saved = json.loads((run_copy / "config.json").read_text())
    saved["train"]["out"] = str(run_copy)  # the copy's own folder: only the damaged file differs
    (run_copy / "config.json").write_text(json.dumps(saved))
    model_config = ModelConfig.from_dict(saved["model"])
    train_config = TrainConfig.from_dict({**saved["train"], "out": str(run_copy)})
    (run_copy / name).write_text(content)
    before = sorted(p.name for p in (run_copy / "checkpoints").iterdir())
    with pytest.raises(RdepthError, match=fragment):
        train_or_reuse(model_config, train_config)
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == before


def test_resume_refuses_a_new_time_limit(trained, tmp_path, capsys):
    run = Path(shutil.copytree(trained, tmp_path / "run"))
    before = (run / "config.json").read_text()
    assert main(["train", "--resume", "--out", str(run), "--time-limit", "2", "--threads", "1"]) == 2
    assert "--time-limit fits a fresh run's schedule" in error_line(capsys)
    assert (run / "config.json").read_text() == before


def test_every_text_flag_must_be_utf8(tmp_path, capsys):
    """The command line's own check (rdepth.cli.options), for flags whose config keeps text as given."""
    folder = b"runs/\xe9t\xe9".decode("utf-8", "surrogateescape")
    assert main(["prepare", "--corpus", "task:chase", "--out", folder]) == 2
    assert "--out is not valid UTF-8 at byte offset 5 (0xe9)" in error_line(capsys)


def test_a_run_stopped_before_its_first_checkpoint_starts_over(run_copy, wiki_small, capsys):
    """Issue 43: a demo killed in its first ~650 steps could not be re-run into its --out ("not empty ...
    but holds no checkpoint"). A folder holding only what a run writes before its first checkpoint starts
    over; anything else in it is still refused."""
    import shutil as sh

    for step in (run_copy / "checkpoints").iterdir():
        sh.rmtree(step) if step.is_dir() else step.unlink()
    (run_copy / "summary.json").unlink()
    assert main(train_argv(wiki_small, run_copy, "--max-steps", "3")) == 0
    assert (run_copy / "summary.json").exists() and any((run_copy / "checkpoints").glob("step_*"))
    for step in (run_copy / "checkpoints").iterdir():
        sh.rmtree(step) if step.is_dir() else step.unlink()
    (run_copy / "summary.json").unlink()
    (run_copy / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(train_argv(wiki_small, run_copy, "--max-steps", "3")) == 2
    assert "holds no checkpoint" in error_line(capsys) and (run_copy / "notes.txt").exists()
