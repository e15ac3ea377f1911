"""Every command on an imported Huginn/raven run (issue 42, Build 2), end to end on a tiny random raven folder.

The module writes a tiny text corpus, prepares it with ``rdepth prepare`` (a byte-level BPE trained on it),
writes a raven-layout checkpoint whose ``tokenizer.json`` is that BPE (as a hub folder ships its own), and
imports it once. Each test then runs one command on the imported run and checks its numbers against the
model's own forward pass on the same windows, or against the same work done one prompt at a time.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_hf_helpers import cli, one_line_error, sentences  # noqa: E402

from rdepth.model.noise import StateNoise

VOCAB = 320


@pytest.fixture(scope="module")
def raven(tmp_path_factory):
    """``SimpleNamespace(run, data, model, tokenizer, val)``: the imported run, its prepared data folder,
    the run's model (float32, eval mode) and tokenizer, and the val split's token ids."""
    from rdepth.data.shards import TokenShards
    from rdepth.interop.hf_raven import write_raven_folder
    from rdepth.run.checkpoint import load_model
    from rdepth.run.heldout import run_tokenizer

    root = tmp_path_factory.mktemp("raven_commands")
    paragraphs = [" ".join(sentences(6, seed=seed)) for seed in range(60)]  # one document each
    (root / "corpus.txt").write_text("\n\n".join(paragraphs))
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert cli(monkeypatch, "prepare", "--corpus", root / "corpus.txt", "--tokenizer", f"bpe:{VOCAB}",
                   "--out", root / "data", "--val-fraction", "0.2") == 0
        folder = write_raven_folder(root / "raven", seed=3, tokenizer_json=(root / "data" / "tokenizer.json").read_text(),
                                    vocab_size=VOCAB)
        assert cli(monkeypatch, "import-hf", "--hf", folder, "--out", root / "run") == 0
    model, config = load_model(root / "run")
    assert (config.positions, config.mlp, config.groups, config.eval_loops) == ("rotary", "swiglu", "1-2", (4,))
    val = np.asarray(TokenShards.open(root / "data").val)
    return SimpleNamespace(run=root / "run", data=root / "data", raven=folder, corpus=root / "corpus.txt",
                           model=model.eval(), tokenizer=run_tokenizer(root / "run"), val=val)


def windows(raven, seq_len: int, count: int) -> torch.Tensor:
    from rdepth.run.heldout import held_out_windows

    return held_out_windows(raven.val, seq_len, count)


@torch.no_grad()
def own_loss(model, batch: torch.Tensor, loops, seed: int = 0, first: int = 0) -> float:
    """Mean next-token cross-entropy of ``batch`` ``[S, T + 1]`` from one forward of the model, window i
    starting its loop from noise row ``first + i`` (as every held-out evaluation does)."""
    noise = StateNoise(seed, list(range(first, first + batch.shape[0])))
    logits = model(batch[:, :-1], loop_counts=loops, noise=noise).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def test_eval_per_loop_budget_is_the_models_own_loss(raven, tmp_path, monkeypatch):
    out = tmp_path / "eval.json"
    assert cli(monkeypatch, "eval", "--checkpoint", raven.run, "--data", raven.data, "--loops", "1", "--loops", "4",
               "--loops", "8", "--batch-size", "4", "--max-batches", "2", "--json", out, "--no-progress") == 0
    results = json.loads(out.read_text())["results"]
    assert [r["loop_counts"] for r in results] == [[1], [4], [8]]
    held_out = windows(raven, 64, 8)  # the 8 windows two batches of 4 cover, spread over the split
    for result in results:
        assert result["tokens"] == 8 * 64
        # eval ran two batches of 4; this is one batch of 8: the loss depends on neither
        assert result["ce"] == pytest.approx(own_loss(raven.model, held_out, result["loop_counts"]), abs=1e-5)
        assert result["ppl"] == pytest.approx(math.exp(result["ce"]), rel=1e-9)
    assert len({round(r["ce"], 4) for r in results}) == 3, "the loop budget does not reach the model"


@pytest.mark.parametrize("policy, tau", [("kl", 0.1), ("entropy_diff", 0.1), ("argmax_stable", 1.0),
                                         ("acceleration", 0.3)])
def test_generate_with_an_exit_policy_at_batch_above_one_equals_each_sample_alone(raven, monkeypatch, capsys,
                                                                                  policy, tau):
    from rdepth.exits.controller import controller_factory
    from rdepth.model.generation import generate

    prompt, new, samples = "The old castle", 10, 3
    assert cli(monkeypatch, "generate", "--checkpoint", raven.run, "--prompt", prompt, "--samples", samples,
               "--temperature", "0", "--exit", policy, "--tau", tau, "--k-max", "8", "--max-new-tokens", new,
               "--show-special") == 0
    batched = capsys.readouterr().out.split("\n---\n")[:samples]
    model, ids = raven.model, torch.tensor([raven.tokenizer.encode(prompt)])
    alone, fixed = [], []
    for sample in range(samples):  # sample i starts every loop from noise row i, as in the batch
        noise = StateNoise(0, [sample])
        factory = controller_factory(policy, tau, [8], lambda: model.readout)
        alone.append(raven.tokenizer.decode(generate(model, ids, new, controller_factory=factory, noise=noise)[0].tolist()))
        fixed.append(raven.tokenizer.decode(generate(model, ids, new, loop_counts=[8], noise=noise)[0].tolist()))
    assert batched == alone
    assert len(set(alone)) > 1, "every sample decoded the same: the noise rows are not reaching the loop"
    assert alone != fixed, "the exit policy changed nothing: it did not exit early"


def test_analyze_measures_the_core_loop(raven, tmp_path, monkeypatch):
    """One looped group (the core block): its step sizes equal those of iterates collected independently
    (float64, as analyze measures), its train-budget loss is the model's own, and no drift-to-loop ratio
    exists (there is no second group to hand on to)."""
    import copy

    from rdepth.geometry import metrics
    from rdepth.geometry.summary import load_summary

    out = tmp_path / "analyze"
    assert cli(monkeypatch, "analyze", "--checkpoints", raven.run, "--data", raven.data, "--out", out,
               "--sequences", "4", "--seq-len", "32", "--long-loops", "8", "--no-progress", "--dlr-curve-loops", "8",
               "--dlr-curve-sequences", "2", "--jacobian-positions", "2") == 0
    summary = load_summary(out)
    assert summary["groups"] == ["1-2"] and summary["budgets"] == {"train": [4], "long": [8]}
    budgets = summary["checkpoints"][0]["budgets"]
    assert set(budgets["train"]["groups"][0]) >= {"step_size", "relative_step_size", "cosine", "acceleration",
                                                    "effective_rank", "convergence", "headline"}
    assert budgets["train"]["dlr"] == {}
    assert (out / "index.html").is_file() and (out / "figures" / "fig3_loop_dynamics.png").is_file()

    held_out = windows(raven, 32, 4)
    model = copy.deepcopy(raven.model).double()
    for budget, loops in (("train", 4), ("long", 8)):
        iterates = []
        with torch.no_grad():
            model(held_out[:, :-1], loop_counts=[loops], noise=StateNoise(0, [0, 1, 2, 3]),
                  observer=lambda group, step, state, active, iterates=iterates: iterates.append(state.clone()))
        states = torch.stack(iterates).flatten(1, 2)  # [K + 1, S * T, d]
        expected = metrics.summarize(metrics.step_sizes(states))["mean"].numpy()
        measured = budgets[budget]["groups"][0]["step_size"]["mean"]
        assert len(measured) == loops
        np.testing.assert_allclose(measured, expected, rtol=1e-5)
        assert budgets[budget]["loss"] == pytest.approx(own_loss(raven.model, held_out, [loops]), abs=1e-4)


def test_sweep_fixed_budgets_are_the_models_own_and_exits_stay_under_the_cap(raven, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    assert cli(monkeypatch, "sweep", "--checkpoint", raven.run, "--data", raven.data, "--out", out,
               "--policies", "kl,entropy_diff,argmax_stable", "--taus", "1e-3,1e-1", "--k-max", "8",
               "--batch-size", "4", "--max-batches", "1", "--block-size", "32", "--no-timing", "--no-progress") == 0
    sweep = json.loads((out / "sweep.json").read_text())
    held_out = windows(raven, 32, 4)
    assert sweep["reference"]["budget"] == [8] and sweep["reference"]["tokens"] == 4 * 32
    assert sweep["reference"]["ce"] == pytest.approx(own_loss(raven.model, held_out, [8]), abs=1e-5)
    assert [point["budget"] for point in sweep["fixed_ladder"]] == [[k] for k in range(1, 9)]
    for point in sweep["fixed_ladder"]:
        assert point["ce"] == pytest.approx(own_loss(raven.model, held_out, point["budget"]), abs=1e-5)
    assert {point["policy"] for point in sweep["points"]} == {"kl", "entropy_diff", "argmax_stable"}
    for point in sweep["points"]:
        assert 1 <= point["mean_steps"][0] <= 8 and math.isfinite(point["ce"])
        assert sum(point["used_histogram"][0]) == 4 * 32
    loose = [p for p in sweep["points"] if p["policy"] == "entropy_diff" and p["value"] == 0.1]
    assert loose and loose[0]["mean_steps"][0] < 8, "a loose threshold never exits early"


def test_calibrate_then_eval_with_its_profile(raven, tmp_path, monkeypatch, capsys):
    profile_path = tmp_path / "profile.json"
    assert cli(monkeypatch, "calibrate", "--checkpoint", raven.run, "--data", raven.data, "--policy", "kl",
               "--mean-steps", "5", "--k-max", "8", "--windows", "4", "--validation-windows", "4", "--batch-size", "4",
               "--out", profile_path) == 0
    profile = json.loads(profile_path.read_text())
    assert profile["policy"] == "kl" and profile["k_max"] == [8]
    realised = profile["calibrated"]["realised"]
    assert realised["calibration"]["steps"] <= 5.0 + 1e-9  # the target, met on the windows it was chosen on
    # calibration windows: the first 4 of 8 spread over the split, noise rows 0..3; validation: the rest, rows 0..3
    held_out = windows(raven, 64, 8)
    for part, rows in (("calibration", held_out[:4]), ("validation", held_out[4:])):
        assert -realised[part]["full_budget"]["quality"] == pytest.approx(own_loss(raven.model, rows, [8]), abs=1e-5)
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert cli(monkeypatch, "eval", "--checkpoint", raven.run, "--data", raven.data, "--exit-profile", profile_path,
               "--batch-size", "4", "--max-batches", "1", "--json", out, "--no-progress") == 0
    assert "with exits" in capsys.readouterr().out
    assert out.is_file()


def test_train_init_from_fine_tunes_with_randomized_depth(raven, tmp_path, monkeypatch, capsys):
    """New text prepared with the run's own tokenizer (``prepare --tokenizer from:RUN``, what fine-tuning
    Huginn-0125 needs: a trained BPE would give other ids), then four steps from the imported weights."""
    from rdepth.data.shards import TokenShards
    from rdepth.data.tokenizers import tokenizer_fingerprint
    from rdepth.run.checkpoint import load_model

    (tmp_path / "new.txt").write_text("\n\n".join(" ".join(sentences(5, seed=100 + s)) for s in range(30)))
    data = tmp_path / "new_data"
    assert cli(monkeypatch, "prepare", "--corpus", tmp_path / "new.txt", "--tokenizer", f"from:{raven.run}",
               "--out", data, "--val-fraction", "0.2") == 0
    shards = TokenShards.open(data)
    assert shards.manifest["tokenizer"] == f"bpe:{VOCAB}"
    assert shards.tokenizer_fingerprint == tokenizer_fingerprint(raven.tokenizer)
    # a BPE trained on the new text has the same name and other ids: refused, as it must be
    assert cli(monkeypatch, "prepare", "--corpus", tmp_path / "new.txt", "--tokenizer", f"bpe:{VOCAB}",
               "--out", tmp_path / "own_bpe", "--val-fraction", "0.2") == 0
    capsys.readouterr()
    err = one_line_error(capsys, cli(monkeypatch, "train", "--init-from", raven.run, "--data", tmp_path / "own_bpe",
                                     "--out", tmp_path / "refused", "--max-steps", "1"))
    assert "tokenizer" in err
    out = tmp_path / "finetune"
    assert cli(monkeypatch, "train", "--init-from", raven.run, "--data", data, "--out", out, "--max-steps", "4",
               "--batch-size", "2", "--warmup-steps", "1", "--eval-every", "4", "--eval-batches", "1",
               "--eval-batch-size", "2", "--checkpoint-every", "4", "--log-every", "1", "--lr", "1e-3") == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
    assert len({tuple(r["loop_counts"][0]) for r in steps}) > 1, "every step ran the same depth"
    tuned, config = load_model(out)
    assert (config.positions, config.mlp, config.qk_bias, config.handoff_norm) == ("rotary", "swiglu", True, True)
    before, after = raven.model.state_dict(), tuned.state_dict()
    assert before.keys() == after.keys()
    assert not torch.equal(before["layers.1.attn.qkv.weight"], after["layers.1.attn.qkv.weight"])
    assert [name for name in before if torch.equal(before[name], after[name])] == [], "some weights never moved"


def test_lm_eval_per_loop_budget_scores_the_models_own_choices(raven, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from rdepth.interop.lm_eval_task import write_task

    name = "raven_endings"
    tasks = write_task(" ".join(sentences(60, seed=9)), tmp_path / "tasks", name, count=12)
    out = tmp_path / "lm_eval.json"
    assert cli(monkeypatch, "lm-eval", "--checkpoint", raven.run, "--tasks", name, "--include-path", tasks,
               "--loops", "1", "--loops", "8", "--json", out, "--bootstrap-iters", "0") == 0
    budgets = json.loads(out.read_text())["budgets"]
    assert [b["loops"] for b in budgets] == [[1], [8]]
    examples = [json.loads(line) for line in (tasks / f"{name}.jsonl").read_text().splitlines()]
    encode = raven.tokenizer.encode
    for budget in budgets:
        correct = 0
        for example in examples:
            context = encode(example["context"])
            scores = []
            for choice in example["choices"]:
                whole = encode(example["context"] + " " + choice)
                with torch.no_grad():
                    logits = raven.model(torch.tensor([whole[:-1]]), loop_counts=budget["loops"],
                                         noise=StateNoise(0, [0])).logits[0]
                logprobs = F.log_softmax(logits, -1)[len(context) - 1:]
                scores.append(float(logprobs.gather(1, torch.tensor(whole[len(context):])[:, None]).sum()))
            correct += int(np.argmax(scores) == example["label"])
        assert budget["results"][name]["acc"] == pytest.approx(correct / len(examples), abs=1e-9)


def test_generate_under_bf16_autocast(raven, monkeypatch, capsys):
    """The Huginn checkpoint is bf16: ``--autocast bf16`` decodes with the cache (the query/key bias once
    promoted the keys alone to float32, and writing them beside bf16 values raised)."""
    assert cli(monkeypatch, "generate", "--checkpoint", raven.run, "--prompt", "The old castle", "--samples", "2",
               "--temperature", "0", "--max-new-tokens", "6", "--autocast", "bf16", "--exit", "kl", "--tau", "0.1",
               "--k-max", "8") == 0
    texts = capsys.readouterr().out.split("\n---\n")[:2]
    assert all(text.startswith("The old castle") and len(text) > len("The old castle") for text in texts)


@pytest.mark.parametrize("command, named", [
    (lambda r, out: ["retrofit", "--checkpoint", r.run, "--groups", "1-2", "--out", out], "already loops"),
    (lambda r, out: ["surrogate", "--teacher", r.run, "--corpus", r.corpus, "--out", out], "already loops"),
    (lambda r, out: ["surrogate", "--teacher", r.raven, "--corpus", r.corpus, "--out", out], "huginn_raven"),
])
def test_commands_that_need_a_plain_transformer_refuse_in_one_line(raven, tmp_path, monkeypatch, capsys, command,
                                                                   named):
    """retrofit makes a plain model loop and the surrogate fits one: a raven run already loops (its core)."""
    err = one_line_error(capsys, cli(monkeypatch, *command(raven, tmp_path / "out")))
    assert named in err
    assert not (tmp_path / "out").exists()


def test_prepare_from_a_folder_without_a_tokenizer_is_one_line(raven, tmp_path, monkeypatch, capsys):
    err = one_line_error(capsys, cli(monkeypatch, "prepare", "--corpus", raven.corpus, "--tokenizer",
                                     f"from:{tmp_path / 'nothing'}", "--out", tmp_path / "data"))
    assert "from:" in err and "nothing" in err
    assert not (tmp_path / "data").exists()
