"""Every command on an imported Ouro / LoopLM run (issue 53, Build 4), end to end on a tiny random Ouro folder.

The module writes a tiny corpus, prepares it (a byte-level BPE trained on it), writes an Ouro-layout checkpoint
whose ``tokenizer.json`` is that BPE, in two shards with an index (as the hub ships larger models), and imports
it once. Each test runs one command on the imported run and checks its numbers against the model's own forward
pass on the same windows, or against the same work done one prompt at a time. Ouro's loop starts from the
token embedding: no noise row reaches it, so samples and windows need no noise keys to agree.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_hf_helpers import cli, real, sentences  # noqa: E402

VOCAB = 320


@pytest.fixture(scope="module")
def ouro(tmp_path_factory):
    """``SimpleNamespace(run, data, model, tokenizer, val)``: the imported run, its prepared data folder, the
    run's model (float32, eval mode) and tokenizer, and the val split's token ids."""
    from rdepth.data.shards import TokenShards
    from rdepth.interop.hf_ouro import write_ouro_folder
    from rdepth.run.checkpoint import load_model
    from rdepth.run.heldout import run_tokenizer

    root = tmp_path_factory.mktemp("ouro_commands")
    paragraphs = [" ".join(sentences(6, seed=seed)) for seed in range(60)]
    (root / "corpus.txt").write_text("\n\n".join(paragraphs))
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert cli(monkeypatch, "prepare", "--corpus", root / "corpus.txt", "--tokenizer", f"bpe:{VOCAB}",
                   "--out", root / "data", "--val-fraction", "0.2") == 0
        folder = write_ouro_folder(root / "ouro", seed=3, tokenizer_json=(root / "data" / "tokenizer.json").read_text(),
                                   shards=2, gate_scale=3.0, vocab_size=VOCAB, max_position_embeddings=64)
        assert cli(monkeypatch, "import-hf", "--hf", folder, "--out", root / "run") == 0
    model, config = load_model(root / "run")
    assert (config.loop_state, config.groups, config.eval_loops) == ("looplm", "0-1", (4,))
    val = np.asarray(TokenShards.open(root / "data").val)
    return SimpleNamespace(run=root / "run", data=root / "data", model=model.eval(),
                           tokenizer=run_tokenizer(root / "run"), val=val)


def windows(ouro, seq_len: int, count: int) -> torch.Tensor:
    from rdepth.run.heldout import held_out_windows

    return held_out_windows(ouro.val, seq_len, count)


@torch.no_grad()
def own_loss(model, batch: torch.Tensor, loops) -> float:
    logits = model(batch[:, :-1], loop_counts=loops).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def test_eval_per_loop_budget_is_the_models_own_loss(ouro, tmp_path, monkeypatch):
    out = tmp_path / "eval.json"
    assert cli(monkeypatch, "eval", "--checkpoint", ouro.run, "--data", ouro.data, "--loops", "1", "--loops", "2",
               "--loops", "4", "--batch-size", "4", "--max-batches", "2", "--json", out, "--no-progress") == 0
    results = json.loads(out.read_text())["results"]
    assert [r["loop_counts"] for r in results] == [[1], [2], [4]]
    held_out = windows(ouro, 64, 8)
    for result in results:
        assert result["tokens"] == 8 * 64
        assert result["ce"] == pytest.approx(own_loss(ouro.model, held_out, result["loop_counts"]), abs=1e-5)
    assert len({round(r["ce"], 4) for r in results}) == 3, "the loop budget does not reach the model"


def _generated(model, tokenizer, prompt, new, factory=None):
    from rdepth.model.generation import generate

    ids = torch.tensor([tokenizer.encode(prompt)])
    return tokenizer.decode(generate(model, ids, new, controller_factory=factory)[0].tolist())


@pytest.mark.parametrize("exits", [False, True])
def test_generate_with_and_without_the_ouro_gate_equals_the_models_own(ouro, monkeypatch, capsys, exits):
    from rdepth.exits.controller import controller_factory

    prompt, new = "The old castle", 8
    flags = ["--exit", "ouro", "--tau", "0.5", "--k-max", "4"] if exits else []
    assert cli(monkeypatch, "generate", "--checkpoint", ouro.run, "--prompt", prompt, "--temperature", "0",
               "--max-new-tokens", new, "--show-special", *flags) == 0
    text = capsys.readouterr().out.split("\n---\n")[0]
    factory = controller_factory("ouro", 0.5, [4], None, {"gate": ouro.model}) if exits else None
    assert text == _generated(ouro.model, ouro.tokenizer, prompt, new, factory)
    if exits:
        assert text != _generated(ouro.model, ouro.tokenizer, prompt, new), "the gate changed nothing"


def test_generate_a_prompts_file_through_the_engine_with_the_gate(ouro, tmp_path, monkeypatch, capsys):
    """--prompts-file: the continuous depth batching engine, 3 slots, rows at their own loop steps under
    Ouro's gate; each prompt's text is what the decoder gives it alone, and the gate stops rows early."""
    from rdepth.exits.controller import controller_factory

    prompts = ["The city", "In 1900 the", "A river", "Music"]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    assert cli(monkeypatch, "generate", "--checkpoint", ouro.run, "--prompts-file", path, "--max-new-tokens", "6",
               "--temperature", "0", "--batch-size", "3", "--device", "cpu", "--exit", "ouro", "--tau", "0.5",
               "--k-max", "4") == 0
    texts, steps, current = [], [], []
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("--- prompt "):
            texts.append("\n".join(current))
            steps.append(float(line.split("[")[1].split("]")[0]))
            current = []
        else:
            current.append(line)
    factory = controller_factory("ouro", 0.5, [4], None, {"gate": ouro.model})
    alone = [_generated(ouro.model, ouro.tokenizer, p, 6, factory).replace("<|endoftext|>", "\n") for p in prompts]
    assert texts == alone
    assert min(steps) < 4, "no row left the loop early"


def test_sweep_judges_the_ouro_gate_beside_rdepths_own_rules(ouro, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    assert cli(monkeypatch, "sweep", "--checkpoint", ouro.run, "--data", ouro.data, "--out", out,
               "--policies", "ouro,step_norm_rel,kl", "--taus", "0.1,0.5,0.9", "--k-max", "4",
               "--batch-size", "4", "--max-batches", "1", "--block-size", "32", "--no-timing", "--no-progress") == 0
    sweep = json.loads((out / "sweep.json").read_text())
    held_out = windows(ouro, 32, 4)
    assert sweep["reference"]["ce"] == pytest.approx(own_loss(ouro.model, held_out, [4]), abs=1e-5)
    for point in sweep["fixed_ladder"]:
        assert point["ce"] == pytest.approx(own_loss(ouro.model, held_out, point["budget"]), abs=1e-5)
    gate = [p for p in sweep["points"] if p["policy"] == "ouro"]
    assert {p["policy"] for p in sweep["points"]} == {"ouro", "step_norm_rel", "kl"} and len(gate) == 3
    assert all(1 <= p["mean_steps"][0] <= 4 and math.isfinite(p["ce"]) for p in gate)
    by_tau = {p["value"]: p["mean_steps"][0] for p in gate}
    assert by_tau[0.9] < by_tau[0.1], "a looser threshold should exit earlier"


def test_calibrate_the_ouro_gate_then_eval_with_its_profile(ouro, tmp_path, monkeypatch, capsys):
    profile_path = tmp_path / "profile.json"
    assert cli(monkeypatch, "calibrate", "--checkpoint", ouro.run, "--data", ouro.data, "--policy", "ouro",
               "--mean-steps", "3", "--k-max", "4", "--windows", "4", "--validation-windows", "4", "--batch-size", "4",
               "--out", profile_path) == 0
    profile = json.loads(profile_path.read_text())
    assert profile["policy"] == "ouro" and profile["k_max"] == [4]
    assert profile["calibrated"]["realised"]["calibration"]["steps"] <= 3.0 + 1e-9
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert cli(monkeypatch, "eval", "--checkpoint", ouro.run, "--data", ouro.data, "--exit-profile", profile_path,
               "--batch-size", "4", "--max-batches", "1", "--json", out, "--no-progress") == 0
    assert "with exits" in capsys.readouterr().out


def test_analyze_measures_the_four_step_loop(ouro, tmp_path, monkeypatch):
    """Ouro's one group over every layer at its 4 steps (and 8): step sizes as iterates collected
    independently give them, the train-budget loss the model's own, and the Jacobian on the tiny model."""
    import copy

    from rdepth.geometry import metrics
    from rdepth.geometry.summary import load_summary

    out = tmp_path / "analyze"
    assert cli(monkeypatch, "analyze", "--checkpoints", ouro.run, "--data", ouro.data, "--out", out,
               "--sequences", "4", "--seq-len", "32", "--long-loops", "8", "--no-progress", "--dlr-curve-loops", "8",
               "--dlr-curve-sequences", "2", "--jacobian-positions", "2") == 0
    summary = load_summary(out)
    assert summary["groups"] == ["0-1"] and summary["budgets"] == {"train": [4], "long": [8]}
    budgets = summary["checkpoints"][0]["budgets"]
    held_out = windows(ouro, 32, 4)
    model = copy.deepcopy(ouro.model).double()
    for budget, loops in (("train", 4), ("long", 8)):
        iterates = []
        with torch.no_grad():
            model(held_out[:, :-1], loop_counts=[loops],
                  observer=lambda group, step, state, active, iterates=iterates: iterates.append(state.clone()))
        states = torch.stack(iterates).flatten(1, 2)
        expected = metrics.summarize(metrics.step_sizes(states[1:]))["mean"].numpy()  # from s_1: s_0 is the zero start
        measured = budgets[budget]["groups"][0]["step_size"]["mean"]
        np.testing.assert_allclose(measured[1:], expected, rtol=1e-5)
        assert budgets[budget]["loss"] == pytest.approx(own_loss(ouro.model, held_out, [loops]), abs=1e-4)
    assert (out / "index.html").is_file()
    radii = []

    def collect(node):  # the spectral radii the Jacobian section reports, wherever they sit
        if isinstance(node, dict):
            if "spectral_radius" in node:
                radii.append(node["spectral_radius"]["median"])
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(summary["checkpoints"][0]["jacobian"])
    assert radii and all(r is not None and r > 0 for r in radii), "the looplm step's Jacobian is empty"


def test_generate_under_bf16_autocast_with_the_gate(ouro, monkeypatch, capsys):
    """The released checkpoints are bfloat16: ``--autocast bf16`` decodes the looplm loop with the cache and the
    gate (the first step's embedding and the zero start meet in one dtype)."""
    assert cli(monkeypatch, "generate", "--checkpoint", ouro.run, "--prompt", "The old castle", "--samples", "2",
               "--temperature", "0", "--max-new-tokens", "6", "--autocast", "bf16", "--exit", "ouro", "--tau", "0.5",
               "--k-max", "4") == 0
    texts = capsys.readouterr().out.split("\n---\n")[:2]
    assert all(text.startswith("The old castle") and len(text) > len("The old castle") for text in texts)


def test_export_gives_the_runs_logits_and_its_gate(ouro, tmp_path, monkeypatch):
    """run -> exported folder: transformers' model of the export gives rdepth's logits bit for bit (the untied
    head, the gate and the looplm loop travel in config.json and the bundled code), cached generation too,
    and the exported model runs Ouro's rule with the gate it carries."""
    transformers = pytest.importorskip("transformers")
    assert cli(monkeypatch, "export", "--checkpoint", ouro.run, "--out", tmp_path / "hf") == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["block"], config["loop_state"], config["tie_head"], config["exit_gate"]) == (
        "peri", "looplm", False, True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for steps in (1, 4):
            assert torch.equal(real(hf(ids, loop_counts=[steps]).logits), ouro.model(ids, loop_counts=steps).logits)
        cached = hf.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)
        uncached = hf.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
        gated = hf(ids, exit_policy={"name": "ouro", "tau": 0.5, "k_max": 4}).logits
        out = hf(ids, output_hidden_states=True)
    # the last hidden state is what the head reads: the last step's state, already normed
    assert torch.equal(F.linear(out.hidden_states[-1], ouro.model.head_weight)[..., :VOCAB], real(out.logits))
    assert torch.equal(cached, uncached)
    from rdepth.exits.controller import controller_factory

    factory = controller_factory("ouro", 0.5, [4], None, {"gate": ouro.model})
    with torch.no_grad():
        assert torch.equal(real(gated), ouro.model(ids, controller=factory()).logits)


def test_lm_eval_per_loop_budget_scores_the_models_own_choices(ouro, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from rdepth.interop.lm_eval_task import write_task

    name = "ouro_endings"
    tasks = write_task(" ".join(sentences(60, seed=9)), tmp_path / "tasks", name, count=12)
    out = tmp_path / "lm_eval.json"
    assert cli(monkeypatch, "lm-eval", "--checkpoint", ouro.run, "--tasks", name, "--include-path", tasks,
               "--loops", "1", "--loops", "4", "--json", out, "--bootstrap-iters", "0") == 0
    budgets = json.loads(out.read_text())["budgets"]
    assert [b["loops"] for b in budgets] == [[1], [4]]
    examples = [json.loads(line) for line in (tasks / f"{name}.jsonl").read_text().splitlines()]
    encode = ouro.tokenizer.encode
    for budget in budgets:
        correct = 0
        for example in examples:
            context = encode(example["context"])
            scores = []
            for choice in example["choices"]:
                whole = encode(example["context"] + " " + choice)
                with torch.no_grad():
                    logits = ouro.model(torch.tensor([whole[:-1]]), loop_counts=budget["loops"]).logits[0]
                logprobs = F.log_softmax(logits, -1)[len(context) - 1:]
                scores.append(float(logprobs.gather(1, torch.tensor(whole[len(context):])[:, None]).sum()))
            correct += int(np.argmax(scores) == example["label"])
        assert budget["results"][name]["acc"] == pytest.approx(correct / len(examples), abs=1e-9)
