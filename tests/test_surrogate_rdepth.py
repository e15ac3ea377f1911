"""rdepth's own plain transformers as surrogate teachers, and each phase read as a loop."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from rdepth.cli.main import main
from rdepth.config import get_preset
from rdepth.errors import RdepthError
from rdepth.model import RecurrentLM
from rdepth.run.checkpoint import save_checkpoint

SMALL = dict(n_layer=3, n_head=2, d_model=32, block_size=48, vocab_size=512, tokenizer="bpe:512")


def _run(tmp_path, wiki_small, groups: str):
    """A randomly initialised rdepth run folder with its tokenizer, as training leaves it."""
    from rdepth.data.shards import TokenShards

    torch.manual_seed(0)
    config = get_preset("tiny", groups=groups, **SMALL)
    model = RecurrentLM(config).eval()
    run = tmp_path / f"run{groups or '-plain'}"
    save_checkpoint(run, 5, model, config)
    TokenShards.open(wiki_small).tokenizer.save(run / "tokenizer")
    return run, model


def test_teacher_states_are_the_model_states(tmp_path, wiki_small):
    from rdepth.surrogate.model import RaptorSurrogate, SurrogateConfig
    from rdepth.surrogate.teachers.registry import load_teacher, text_tokenizer

    run, model = _run(tmp_path, wiki_small, "")
    teacher = load_teacher(str(run))
    batch = text_tokenizer(str(run), 64).encode(["The river flows north.", "A castle stands on the old hill above it."])
    assert batch.ids.shape[1] <= 48 and not batch.mask[0].all() and batch.mask[1].all()
    with torch.no_grad():
        states = teacher.layer_states(batch.ids, batch.mask)
        expected = model.embed(batch.ids)
        assert torch.equal(states[0], expected)
        for layer in range(3):
            expected = model.run_layers([layer], expected)
            assert torch.equal(states[layer + 1], expected)
        logits = F.linear(teacher(batch.ids, batch.mask), model.wte.weight)[..., :512]
        assert torch.equal(logits, model(batch.ids).logits)
        # k = L surrogate initialised from the teacher is the teacher; a random block is a sandwich block.
        exact = RaptorSurrogate(teacher, SurrogateConfig((1, 1, 1)))
        for ours, theirs in zip(exact.layer_states(batch.ids, batch.mask), states, strict=False):
            assert torch.equal(ours, theirs)
        fresh = RaptorSurrogate(teacher, SurrogateConfig((2, 1), init="random"))
        assert type(fresh.blocks[0]) is type(teacher.layers[0])
        assert fresh.layer_states(batch.ids, batch.mask)[-1].shape == states[-1].shape


def test_recurrent_model_is_refused(tmp_path, wiki_small):
    from rdepth.surrogate.teachers.rdepth_teacher import load_rdepth_teacher

    run, _ = _run(tmp_path, wiki_small, "1")
    with pytest.raises(RdepthError, match="already loops"):
        load_rdepth_teacher(run)


def test_phase_loop_geometry_known_answers():
    from rdepth.surrogate.measure.dynamics import phase_loop_geometry

    # Depths 0..3 on a straight line with halving steps (phase 0: 3 layers), then one 90-degree turn.
    e0, e1 = torch.eye(2)
    points = [torch.zeros(2), e0, 1.5 * e0, 1.75 * e0, 1.75 * e0 + 2 * e1]
    states = torch.stack(points)[:, None, None, :].expand(5, 2, 3, 2).clone()  # (S, N, T, D)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    phases = phase_loop_geometry(states, mask, (3, 1))
    assert phases[0]["layers"] == [0, 2] and phases[1]["layers"] == [3, 3]
    assert phases[0]["step_size"] == pytest.approx([1.0, 0.5, 0.25])
    assert phases[0]["cosine"] == pytest.approx([1.0, 1.0])
    assert phases[1]["step_size"] == pytest.approx([2.0]) and phases[1]["cosine"] == []


def test_surrogate_command_on_an_rdepth_run(tmp_path, wiki_small, capsys):
    run, _ = _run(tmp_path, wiki_small, "")
    out = tmp_path / "surrogate"
    code = main(["surrogate", "--teacher", str(run), "--corpus", "wiki", "--out", str(out), "--k", "2",
                 "--n-fit", "16", "--n-eval", "8", "--batch-size", "8", "--steps-block", "2", "--steps-joint", "2",
                 "--threads", "1"])
    assert code == 0, capsys.readouterr().err
    dynamics = json.loads((out / "dynamics.json").read_text())
    lengths = json.loads((out / "results.json").read_text())["phases"]["raptor"]
    assert [len(entry["step_size"]) for entry in dynamics["raptor"]["loop_geometry"]] == lengths
    assert "each phase read as a loop" in (out / "index.html").read_text()


def test_phase_geometry_uses_the_analyze_format(tmp_path):
    """A straight-line phase and a one-layer phase, through the streaming observer: exact steps."""
    from rdepth.geometry.summary import group_headline, load_summary
    from rdepth.surrogate.measure.geometry import write_phase_geometry

    e0, e1 = torch.eye(2, dtype=torch.float64)
    points = [e0, 2 * e0, 2.5 * e0, 2.75 * e0, 2.75 * e0 + 2 * e1]
    states = torch.stack(points)[:, None, None, :].expand(5, 3, 4, 2).clone()  # (S, N, T, D)
    states[:, :, :, 1] += torch.arange(4, dtype=torch.float64)  # tokens differ, steps do not
    mask = torch.tensor([[True] * 4, [True, True, False, False], [True, False, False, False]])
    write_phase_geometry(tmp_path, {"teacher": states, "raptor": states}, mask, (3, 1))
    summary = load_summary(tmp_path)
    assert summary["groups"] == ["0-2", "3"] and [c["label"] for c in summary["checkpoints"]] == ["teacher", "raptor"]
    first, second = summary["checkpoints"][1]["budgets"]["train"]["groups"]
    assert first["step_size"]["mean"] == pytest.approx([1.0, 0.5, 0.25])
    assert first["cosine"]["mean"] == pytest.approx([1.0, 1.0])
    assert second["step_size"]["mean"] == pytest.approx([2.0])
    # three steps: one cosine after the jump from the start, fewer than a settled cosine needs (no plateau)
    assert first["headline"] == group_headline(first) and first["headline"]["settled_cosine"] is None
    assert summary["scale_budget"] == "train" and summary["budgets"] == {"train": [3, 1]}
    assert summary["checkpoints"][0]["budgets"]["train"]["loss"] is None
    dlr = summary["checkpoints"][0]["budgets"]["train"]["dlr"]["0-2->3"]
    assert dlr["literal"]["mean"] == pytest.approx(0.0) and dlr["first"]["mean"] == pytest.approx(2.0 / (1.75 / 3))
    assert dlr["first_refine"]["mean"] == pytest.approx(2.0 / (0.75 / 2))  # steps 0.5 and 0.25 only
    page = (tmp_path / "index.html").read_text()
    assert "Loop geometry of the phases" in page and "figures/fig3_loop_dynamics.png" in page
    assert (tmp_path / "figures" / "fig2_dlr.png").is_file()
