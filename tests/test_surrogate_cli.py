"""``rdepth surrogate`` end to end on a tiny random teacher, its help, and its user errors."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from rdepth.cli.main import main

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = ["the", "a", "river", "city", "old", "new", "small", "large", "north", "south", "king", "queen", "museum", "library", "station", "garden", "bridge", "tower", "market", "school", "village", "forest", "mountain", "lake", "island", "road"]

@pytest.fixture
def tiny_teacher(tmp_path):
    """A random 3-layer BERT with a word-level tokenizer.json, and a small text corpus."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(sorted(set(WORDS)))}, ".": len(set(WORDS)) + 2}
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=3,
                                     num_attention_heads=2, intermediate_size=24, max_position_embeddings=64)
    folder = tmp_path / "teacher"
    transformers.BertModel(config).save_pretrained(folder, safe_serialization=True)
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    g = torch.Generator().manual_seed(1)
    sentences = []
    for _ in range(80):
        words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(torch.randint(6, 12, (1,), generator=g)),),
                                                      generator=g)]
        sentences.append(" ".join(words).capitalize() + ".")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(sentences))
    return folder, corpus


def run_cli(*args) -> int:
    return main(["surrogate", *map(str, args)])


def small_flags(teacher, corpus, out, k=2):
    return ["--teacher", teacher, "--corpus", corpus, "--out", out, "--k", k, "--n-fit", 24, "--n-eval", 12,
            "--batch-size", 8, "--steps-block", 3, "--steps-joint", 4, "--log-every", 2, "--threads", 1]


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["surrogate", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--teacher", "--k", "--out", "--phase-method", "--steps-joint", "--first-token-weight"):
        assert flag in text


def test_tiny_end_to_end_writes_report(tiny_teacher, tmp_path, capsys, monkeypatch):
    from rdepth.surrogate import run as surrogate_run

    folder, corpus = tiny_teacher
    out = tmp_path / "run"
    seen = []  # which banks the phases are chosen from: (fit, held-out) example counts
    choose = surrogate_run.choose_phases

    def spy(fit_bank, eval_bank, *args):
        seen.append((fit_bank.n_examples, eval_bank.n_examples))
        return choose(fit_bank, eval_bank, *args)

    monkeypatch.setattr(surrogate_run, "choose_phases", spy)
    assert run_cli(*small_flags(folder, corpus, out)) == 0
    page = (out / "index.html").read_text()
    assert "Retention" in page and "figures/similarity_cka.png" in page
    results = json.loads((out / "results.json").read_text())
    assert set(results["models"]) == {"raptor", "equal_split", "truncated"}
    assert sum(results["phases"]["raptor"]) == 3
    for name, metrics in results["models"].items():
        assert len(metrics["layer_cosine"]) == 3
        assert -1.0 <= metrics["pairwise_spearman"] <= 1.0, name
    phases = json.loads((out / "phases.json").read_text())
    assert set(phases["by_similarity"]) == {"pooled_cosine", "token_cosine", "cka"}
    assert seen == [(results["n_fit"], results["n_eval"])] and results["n_fit"] != results["n_eval"]
    assert phases["chosen_on"] == "fit" and set(phases["by_similarity_eval"]) == set(phases["by_similarity"])
    assert results["phases"]["raptor"] == phases["chosen"] == phases["by_similarity"]["pooled_cosine"]["dp"]["lengths"]
    assert (out / "similarity_eval.npz").is_file() and "fit sentences" in page
    for suffix in ("png", "svg"):
        assert (out / "figures" / f"fidelity.{suffix}").is_file()
    assert (out / "surrogate" / "surrogate.safetensors").is_file()
    assert (out / "metrics.jsonl").read_text().strip()
    assert "report:" in capsys.readouterr().out


def one_line_error(capsys, code):
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rdepth surrogate: error:") and "\n" not in err and "Traceback" not in err
    return err


def test_bad_inputs_are_one_line_errors(tiny_teacher, tmp_path, capsys):
    folder, corpus = tiny_teacher
    err = one_line_error(capsys, run_cli(*small_flags(tmp_path / "missing", corpus, tmp_path / "a")))
    assert "neither a known name" in err
    err = one_line_error(capsys, run_cli(*small_flags(folder, corpus, tmp_path / "b", k=4)))
    assert "exceeds the teacher's 3 layers" in err
    err = one_line_error(capsys, run_cli(*small_flags(folder, corpus, tmp_path / "c", k=0)))
    assert "k must be >= 1" in err
    err = one_line_error(capsys, run_cli(*small_flags(folder, corpus, tmp_path / "d"), "--similarity", "bogus"))
    assert "similarity" in err
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    err = one_line_error(capsys, run_cli(*small_flags(folder, corpus, tmp_path / "e")))
    assert "not a readable safetensors file" in err
    assert not (tmp_path / "e" / "index.html").exists()


def gloss_folder(tmp_path):
    """Constructed WordNet data files: 60 glosses of the tiny vocabulary in 3 lexicographer classes."""
    from test_wordnet_probe import write_wordnet

    g = torch.Generator().manual_seed(2)
    entries = []
    for i in range(60):
        label = (5, 15, 38)[i % 3]
        words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (5,), generator=g)]
        entries.append((label, "n" if label < 29 else "v", " ".join([WORDS[i % 3 + 3], *words])))
    write_wordnet(tmp_path / "wordnet", {"data.noun": [e for e in entries if e[1] == "n"],
                                         "data.verb": [e for e in entries if e[1] == "v"]})
    return tmp_path / "wordnet"


def test_tiny_wordnet_probe_end_to_end(tiny_teacher, tmp_path, capsys):
    folder, corpus = tiny_teacher
    out = tmp_path / "probe"
    assert run_cli(*small_flags(folder, corpus, out), "--probe", "wordnet", "--wordnet-dir", gloss_folder(tmp_path),
                   "--probe-train", 36, "--probe-test", 24, "--probe-k", "1,3") == 0
    results = json.loads((out / "results.json").read_text())
    probe = results["probe"]
    assert probe["compare_k"] == [1, 2, 3] and set(probe["by_k"]) == {"1", "2", "3"}  # --k 2 added
    assert probe["glosses"] == {"train": 36, "test": 24} and probe["n_classes"] == 45
    assert probe["by_k"]["2"]["phases"] == results["phases"]["raptor"]  # the run's own k = 2 surrogate
    assert probe["by_k"]["3"]["equal_split"] == [1, 1, 1] == probe["by_k"]["3"]["phases"]
    teacher = probe["teacher"]
    floor = probe["floor"]["token_embedding_probe_accuracy"]
    assert teacher["teacher_probe_retention"] == 1.0
    if teacher["own_probe_accuracy"] > floor:  # a random tiny teacher need not beat its embeddings
        assert teacher["teacher_probe_normalised"] == pytest.approx(1.0)
    else:  # undefined (NaN), which the results file writes as null (standard JSON)
        assert teacher["teacher_probe_normalised"] is None
    for _k, entry in probe["by_k"].items():
        for kind in ("raptor", "equal_split", "truncated"):
            metrics = entry["models"][kind]
            assert 0.0 <= metrics["own_probe_accuracy"] <= 1.0
            assert metrics["own_probe_retention"] == pytest.approx(metrics["own_probe_accuracy"]
                                                                   / teacher["own_probe_accuracy"])
    # three layers, k = 3: the truncated teacher is the teacher itself
    assert probe["by_k"]["3"]["models"]["truncated"]["teacher_probe_accuracy"] == teacher["teacher_probe_accuracy"]
    page = (out / "index.html").read_text()
    assert "lexicographer classes" in page and "token-embedding mean (floor)" in page
    assert (out / "figures" / "probe_own_probe.png").is_file()


def test_wordnet_probe_bad_inputs_are_one_line_errors(tiny_teacher, tmp_path, capsys):
    folder, corpus = tiny_teacher
    err = one_line_error(capsys, run_cli(*small_flags(folder, corpus, tmp_path / "a"), "--probe", "wordnet",
                                         "--wordnet-dir", tmp_path / "nowhere"))
    assert "has no data.noun" in err
    glosses = gloss_folder(tmp_path)
    err = one_line_error(capsys, run_cli(*small_flags(folder, corpus, tmp_path / "b"), "--probe", "wordnet",
                                         "--wordnet-dir", glosses, "--probe-train", 50, "--probe-test", 20))
    assert "exceeds the 60 WordNet glosses" in err
    err = one_line_error(capsys, run_cli(*small_flags(folder, corpus, tmp_path / "c"), "--probe", "wordnet",
                                         "--wordnet-dir", glosses, "--probe-train", 20, "--probe-test", 20,
                                         "--probe-k", "4"))
    assert "exceeds the teacher's 3 layers" in err
    (glosses / "data.verb").write_text("00000001 99 v 01 run 0 000 | go fast\n")
    err = one_line_error(capsys, run_cli(*small_flags(folder, corpus, tmp_path / "d"), "--probe", "wordnet",
                                         "--wordnet-dir", glosses))
    assert "data.verb line 1" in err and "outside 0..44" in err
    err = one_line_error(capsys, run_cli(*small_flags(folder, corpus, tmp_path / "e"), "--probe", "bogus"))
    assert "probe must be one of" in err
    assert not any((tmp_path / name / "index.html").exists() for name in "abcde")
