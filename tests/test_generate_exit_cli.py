"""``rdepth generate --exit POLICY --tau X [--k-max N]`` and ``--autocast``: the CLI against the Python API."""

from __future__ import annotations

import pytest
import torch

import rdepth.run.generate_text as generate_text_module
from rdepth.cli.main import main
from rdepth.exits.controller import controller_factory
from rdepth.model.generation import generate
from rdepth.model.noise import StateNoise
from rdepth.run.checkpoint import load_model
from rdepth.run.heldout import run_tokenizer

PROMPT = "The city"


@pytest.fixture(scope="module")
def run(tiny_text_run):
    return tiny_text_run


def cli_texts(capsys, run, *flags) -> list[str]:
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(run), "--prompt", PROMPT, "--max-new-tokens", "10",
                 "--temperature", "0", "--samples", "2", "--device", "cpu", *flags]) == 0
    return capsys.readouterr().out.split("\n---\n")[:-1]


def api_texts(run, name, tau, k_max, autocast=None, **options) -> list[str]:
    """The same generation composed from the Python API: controller_factory's controllers, the same rule in every group."""
    model, _ = load_model(run)
    tokenizer = run_tokenizer(run)
    prompt = torch.tensor([tokenizer.encode(PROMPT)] * 2)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        tokens = generate(model, prompt, 10, temperature=0.0, noise=StateNoise.consecutive(0, 0, 2),
                          controller_factory=lambda: controller_factory(name, tau, k_max, lambda: model.readout, options)())
    return [tokenizer.decode(row).replace("<|endoftext|>", "\n") for row in tokens.tolist()]


@pytest.mark.parametrize("name, tau, k_max", [("kl", 1e-2, 3), ("acceleration", 0.3, 4), ("step_norm", 1e9, 3)])
def test_cli_exit_gives_the_python_apis_tokens(capsys, run, name, tau, k_max):
    texts = cli_texts(capsys, run, "--exit", name, "--tau", str(tau), "--k-max", str(k_max))
    assert len(texts) == 2 and all(text.startswith(PROMPT) for text in texts)
    assert texts == api_texts(run, name, tau, k_max)
    if tau == 1e9:  # every token leaves each loop after its first step: the fixed budget of one step
        assert texts == cli_texts(capsys, run, "--loops", "1")


def test_cli_exit_without_tau_takes_the_policys_default_and_k_max_defaults_to_twice_the_eval_loops(capsys, run):
    _, config = load_model(run)
    caps = [2 * k for k in config.default_eval_loops]
    # patience 2, the policy's default
    assert cli_texts(capsys, run, "--exit", "argmax_stable") == api_texts(run, "argmax_stable", None, caps)
    assert cli_texts(capsys, run, "--exit", "argmax_stable", "--tau", "1") == \
        api_texts(run, "argmax_stable", None, caps, patience=1)  # --tau is the policy's parameter
    assert cli_texts(capsys, run, "--exit", "fixed") == api_texts(run, "fixed", None, caps)


def test_cli_autocast_runs_generation_under_bf16(capsys, run, monkeypatch):
    seen = []

    def probe(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
        return generate(*args, **kwargs)

    monkeypatch.setattr(generate_text_module, "generate", probe)
    texts = cli_texts(capsys, run, "--exit", "kl", "--tau", "1e-2", "--k-max", "3", "--autocast", "bf16")
    assert seen == [torch.bfloat16]
    assert texts == api_texts(run, "kl", 1e-2, 3, autocast=torch.bfloat16)
    cli_texts(capsys, run, "--loops", "2")
    assert seen[-1] is False  # the default: no autocast


def test_cli_exit_options_reach_the_policy(capsys, run):
    """``--exit-options direction=old_new,prior=uniform`` is Geiping et al.'s kl: the same tokens as the API
    built with those options; at a huge tau the uniform start stops every token at step 1 (the fixed budget
    of one step), where the default start never compares step 1 (two steps)."""
    flags = ["--exit", "kl", "--tau", "1e9", "--k-max", "3"]
    uniform = cli_texts(capsys, run, *flags, "--exit-options", "direction=old_new,prior=uniform")
    assert uniform == api_texts(run, "kl", 1e9, 3, direction="old_new", prior="uniform")
    assert uniform == cli_texts(capsys, run, "--loops", "1")
    assert cli_texts(capsys, run, *flags) == cli_texts(capsys, run, "--loops", "2")


@pytest.mark.parametrize("flags, fragment", [
    (["--exit", "kl", "--tau", "1e-3", "--exit-options", "prior"], "--exit-options wants KEY=VALUE"),
    (["--exit", "kl", "--tau", "1e-3", "--exit-options", "prior=flat"], "prior must be one of none, uniform"),
    (["--exit", "kl", "--tau", "1e-3", "--exit-options", "speed=2"], "unknown option(s) speed"),
    (["--exit-options", "prior=uniform"], "give --exit too"),
    (["--exit", "nope", "--tau", "1e-3"], "unknown exit policy 'nope'"),
    (["--exit", "kl", "--tau", "-1"], "tau must be a finite number > 0"),
    (["--exit", "kl", "--tau", "nan"], "tau must be a finite number > 0"),
    (["--exit", "kl", "--tau", "x"], "--tau expects float"),
    (["--exit", "kl"], "needs a threshold tau"),
    (["--exit", "fixed", "--tau", "1e-3"], "takes no tau"),
    (["--exit", "kl", "--tau", "1e-3", "--k-max", "0"], "k_max must be integers in [1, 1024]"),
    (["--exit", "kl", "--tau", "1e-3", "--k-max", "3,3,3"], "3 k_max values for a model with 2 groups"),
    (["--exit", "kl", "--tau", "1e-3", "--exit-profile", "p.json"], "give --exit or --exit-profile, not both"),
    (["--exit", "kl", "--tau", "1e-3", "--loops", "2"], "--exit replaces --loops"),
    (["--tau", "1e-3"], "give --exit too"),
    (["--autocast", "fp8"], "autocast must be one of none, bf16, fp16"),
])
def test_bad_exit_flags_are_one_line_with_status_2(capsys, run, flags, fragment):
    capsys.readouterr()
    try:
        code = main(["generate", "--checkpoint", str(run), "--device", "cpu", *flags])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2
    line = captured.err.strip()
    assert "\n" not in line and fragment in line, line
    assert captured.out == ""


def test_help_lists_the_exit_flags(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--exit POLICY", "--tau", "--k-max", "--exit-profile", "--autocast"):
        assert flag in text, flag


# ------------------------------------------------------------------ many prompts through the engine
PROMPTS = ["The city", "In 1900 the", "A river", "Music"]


def many_texts(capsys, run, tmp_path, batch, *flags) -> list[str]:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([PROMPTS[0], "", *PROMPTS[1:]]) + "\n")
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(run), "--prompts-file", str(prompts), "--max-new-tokens", "6",
                 "--temperature", "0", "--batch-size", str(batch), "--device", "cpu", *flags]) == 0
    return _texts(capsys.readouterr().out)


def _texts(out: str) -> list[str]:
    """The continuations printed before each '--- prompt i, sample s: ...' line."""
    texts, current = [], []
    for line in out.splitlines():
        if line.startswith("--- prompt "):
            texts.append("\n".join(current))
            current = []
        else:
            current.append(line)
    return texts


@pytest.mark.parametrize("flags", [(), ("--exit", "kl", "--tau", "0.01", "--k-max", "3")])
def test_prompts_file_gives_each_prompts_own_text_whatever_the_batch(capsys, run, tmp_path, flags):
    """Each prompt of the file decodes as it would alone (request i keyed StateNoise(seed, [i])), with batch 1
    or 3 slots, and blank lines are skipped."""
    texts = {batch: many_texts(capsys, run, tmp_path, batch, *flags) for batch in (1, 3)}
    assert texts[1] == texts[3] and len(texts[1]) == len(PROMPTS)
    model, _ = load_model(run)
    tokenizer = run_tokenizer(run)
    for index, prompt in enumerate(PROMPTS):
        factory = (lambda: controller_factory("kl", 0.01, 3, lambda: model.readout)()) if flags else None
        tokens = generate(model, torch.tensor([tokenizer.encode(prompt)]), 6, temperature=0.0,
                          noise=StateNoise(0, [index]), controller_factory=factory)
        assert texts[1][index] == tokenizer.decode(tokens[0].tolist()).replace("<|endoftext|>", "\n")


def test_prompts_file_through_a_static_tick_that_runs_ahead_gives_the_same_texts(capsys, run, tmp_path):
    """--tick static --ahead 3 (the device enters each row's greedy token itself, three ticks a call): the
    texts of the eager tick, at a fixed budget and under step_norm_rel."""
    for rule in ((), ("--exit", "step_norm_rel", "--tau", "0.3", "--k-max", "3")):
        eager = many_texts(capsys, run, tmp_path, 3, *rule)
        assert many_texts(capsys, run, tmp_path, 3, *rule, "--tick", "static", "--ahead", "3") == eager


def test_prompts_file_bad_input_is_one_line(capsys, run, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    for flags, message in ((["--prompts-file", str(tmp_path / "missing.txt")], "no such file"),
                           (["--prompts-file", str(empty)], "holds no prompt"),
                           (["--prompts-file", str(empty), "--draft-loops", "1", "--temperature", "0"], "give --speculate too"),
                           (["--kv-layout", "shared"], "with --prompts-file"),
                           (["--prompts-file", str(empty), "--ahead", "2"], "--ahead runs several ticks"),
                           (["--ahead", "0"], "ahead must be an integer in [1, 64]")):
        capsys.readouterr()
        assert main(["generate", "--checkpoint", str(run), "--device", "cpu", *flags]) != 0
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
