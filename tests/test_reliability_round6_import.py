"""Reliability round 6 (issue 61), ``rdepth import-hf``: one reader finds every importer's weight files as
transformers does and refuses a malformed index in one line; a killed import's staging folder is removed by the
next; the help names every format it reads. Each test fails without its fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_hf_helpers import cli, one_line_error, tiny_run, tiny_tokenizer

from rdepth.interop.hf_ouro import write_ouro_folder
from rdepth.interop.hf_raven import write_raven_folder

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
INDEX = "model.safetensors.index.json"
SHARD = "model-00001-of-00001.safetensors"


def _tokenizer_json(tmp_path: Path) -> str:
    tiny_tokenizer().save(tmp_path / "bpe")
    return (tmp_path / "bpe" / "tokenizer.json").read_text()


def _ouro(folder: Path, seed: int, tokenizer_json: str | None = None) -> Path:
    return write_ouro_folder(folder, seed=seed, tokenizer_json=tokenizer_json, vocab_size=tiny_tokenizer().vocab_size)


def _raven(folder: Path, seed: int, tokenizer_json: str | None = None) -> Path:
    return write_raven_folder(folder, seed=seed, tokenizer_json=tokenizer_json, vocab_size=tiny_tokenizer().vocab_size)


def _exported(folder: Path, seed: int, tokenizer_json: str | None = None) -> Path:
    """An ``rdepth export`` of a random tiny run (its own tokenizer: ``tokenizer_json`` is not used)."""
    run, _ = tiny_run(folder.parent / f"run{seed}", seed=seed)
    with pytest.MonkeyPatch.context() as patch:
        assert cli(patch, "export", "--checkpoint", run, "--out", folder) == 0
    return folder


WRITERS = {"ouro": _ouro, "raven": _raven, "export": _exported}


def _imported_weights(run: Path) -> bytes:
    return (run / "checkpoints" / "step_000000" / "model.safetensors").read_bytes()


# ---------------------------------------------------------------- item 5: the single file wins, for every reader
@pytest.mark.parametrize("kind", ["ouro", "raven"])
def test_a_folder_holding_one_file_and_a_sharded_index_imports_the_file(tmp_path, monkeypatch, kind):
    """Issue 61 (5): an Ouro folder holding both ``model.safetensors`` and a sharded index imported the shards;
    transformers' ``from_pretrained`` (and the raven reader since round 5) take the single file."""
    write = WRITERS[kind]
    text = _tokenizer_json(tmp_path)
    both = write(tmp_path / "both", seed=3, tokenizer_json=text)
    other = write(tmp_path / "other", seed=9)  # the shard: another model of the same shapes
    (both / SHARD).write_bytes((other / "model.safetensors").read_bytes())
    names = load_file(str(other / "model.safetensors"))
    (both / INDEX).write_text(json.dumps({"weight_map": {name: SHARD for name in names}}))
    alone = write(tmp_path / "alone", seed=3, tokenizer_json=text)
    shards = write(tmp_path / "shards", seed=9, tokenizer_json=text)
    for source in (both, alone, shards):
        assert cli(monkeypatch, "import-hf", "--hf", source, "--out", tmp_path / f"run_{source.name}") == 0
    got = {name: _imported_weights(tmp_path / f"run_{name}") for name in ("both", "alone", "shards")}
    assert got["both"] == got["alone"] and got["both"] != got["shards"]


# ---------------------------------------------------------------- item 6: an index of the wrong shape
def _sharded(folder: Path) -> Path:
    """The folder's single file moved into one shard with a correct index (every importer reads it)."""
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").rename(folder / SHARD)
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {name: SHARD for name in weights}}))
    return folder


def _edit_index(folder: Path, edit) -> None:
    index = json.loads((folder / INDEX).read_text())
    (folder / INDEX).write_text(json.dumps(edit(index)))


BAD_INDEXES = [
    ("integers", lambda index: {**index, "weight_map": {name: 1 for name in index["weight_map"]}}, "not a file name"),
    ("a list", lambda index: [index], "not an object"),
    ("no weight_map", lambda index: {"metadata": {}}, "weight_map is None"),
    ("an empty weight_map", lambda index: {"weight_map": {}}, "weight_map is {}"),
    ("a list weight_map", lambda index: {"weight_map": list(index["weight_map"])}, "not a mapping"),
    ("a null shard", lambda index: {"weight_map": {**index["weight_map"], "model.x": None}}, "not a file name"),
    ("a path", lambda index: {"weight_map": {name: "../" + SHARD for name in index["weight_map"]}}, "outside"),
]


@pytest.mark.parametrize("kind", ["raven", "ouro", "export"])
@pytest.mark.parametrize("case, edit, words", BAD_INDEXES, ids=[case[0] for case in BAD_INDEXES])
def test_a_malformed_index_is_one_line_naming_it(tmp_path, monkeypatch, capsys, kind, case, edit, words):
    """Issue 61 (6): a raven index whose weight_map values are integers was a TypeError traceback; the index's
    shape is checked once, in the reader every importer uses."""
    folder = _sharded(WRITERS[kind](tmp_path / kind, seed=3, tokenizer_json=_tokenizer_json(tmp_path)))
    assert cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "ok") == 0  # the index as written
    capsys.readouterr()
    _edit_index(folder, edit)
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run"))
    assert str(folder / INDEX) in err and words in err, err
    assert not (tmp_path / "run").exists()


def test_a_deeply_nested_index_is_one_line(tmp_path, monkeypatch, capsys):
    folder = _sharded(_raven(tmp_path / "raven", seed=3, tokenizer_json=_tokenizer_json(tmp_path)))
    (folder / INDEX).write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run"))
    assert str(folder / INDEX) in err and "not a safetensors index" in err


# ---------------------------------------------------------------- item 9: a killed import's staging folder
KILLED_IMPORT = (
    "import os, signal, sys\n"
    "import rdepth.interop.hf_import as hf_import\n"
    "from rdepth.cli.main import main\n"
    "def killed(folder, *args, **kwargs):\n"
    "    (folder / 'half-written').write_text('x')\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "hf_import.save_checkpoint = killed\n"
    "sys.exit(main(['import-hf', '--hf', sys.argv[1], '--out', sys.argv[2]]))\n"
)


def _hidden(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.startswith("."))


def test_the_next_import_removes_what_a_killed_import_left(tmp_path, monkeypatch):
    """Issue 61 (9): a SIGKILLed import-hf left a hidden staging folder beside --out that the next import did
    not remove. The next import of the same --out removes it, and nothing that is not a staging folder of that
    --out (another output's, a user's folder of a like name)."""
    folder = _ouro(tmp_path / "hf" / "ouro", seed=3, tokenizer_json=_tokenizer_json(tmp_path))
    parent = tmp_path / "runs"
    result = subprocess.run([sys.executable, "-c", KILLED_IMPORT, str(folder), str(parent / "run")], env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr
    debris = _hidden(parent)
    assert not (parent / "run").exists() and any(name.startswith(".run.") for name in debris), debris
    kept = [parent / ".run.notes", parent / ".run.x.0123abcd.staging", parent / ".run.0123abcd.staging.old"]
    for path in kept:  # a user's folder, the staging folder of the output run.x, a name that only looks like one
        path.mkdir()
        (path / "mine").write_text("keep")
    assert cli(monkeypatch, "import-hf", "--hf", folder, "--out", parent / "run") == 0
    assert (parent / "run" / "checkpoints" / "step_000000" / "model.safetensors").is_file()
    assert _hidden(parent) == sorted(path.name for path in kept)
    assert all((path / "mine").read_text() == "keep" for path in kept)


HOLDING_WRITER = (
    "import sys\n"
    "from rdepth.interop.output import staged_folder\n"
    "with staged_folder(sys.argv[1], 'import-hf') as staging:\n"
    "    (staging / 'theirs').write_text('x')\n"
    "    print(staging, flush=True)\n"
    "    sys.stdin.read()\n"
)


def test_a_running_writers_staging_folder_is_left_to_it(tmp_path, monkeypatch, capsys):
    """A staging folder whose writer still runs is not debris: a second import of the same --out is refused in
    one line naming the holder, and the first finishes as if alone."""
    folder = _ouro(tmp_path / "ouro", seed=3, tokenizer_json=_tokenizer_json(tmp_path))
    writer = subprocess.Popen([sys.executable, "-c", HOLDING_WRITER, str(tmp_path / "run")], env=ENV, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        staging = Path(writer.stdout.readline().strip())
        err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run"))
        assert f"in use by rdepth import-hf (pid {writer.pid})" in err, err
        assert (staging / "theirs").is_file()
    finally:
        writer.communicate("", timeout=60)
    assert writer.returncode == 0 and (tmp_path / "run" / "theirs").is_file()
    assert _hidden(tmp_path) == []  # its lock file gone with it


# ---------------------------------------------------------------- item 12: the help names every format
def test_import_hf_help_and_the_readme_name_every_format_it_reads(monkeypatch, capsys):
    """Issue 61 (12): ``import-hf --help`` named GPT-2, rdepth exports and Huginn-0125 but not Ouro, which it
    reads. Its help, its refusal and the README's command table now come from one table of the formats."""
    from rdepth.interop.config import IMPORT_FORMATS
    from rdepth.interop.hf_import import FORMAT_NAMES, IMPORTERS

    assert set(IMPORT_FORMATS) == set(IMPORTERS) == set(FORMAT_NAMES)
    with pytest.raises(SystemExit):
        cli(monkeypatch, "import-hf", "--help")
    described = " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        cli(monkeypatch, "--help")
    listed = " ".join(capsys.readouterr().out.split())
    shorts = ", ".join(form.short for form in IMPORT_FORMATS.values())
    assert f"import a Hugging Face folder ({shorts}) as an rdepth run" in listed
    for kind, form in IMPORT_FORMATS.items():
        assert f"{form.name} (model_type {kind}" in described
    assert "Ouro (LoopLM) folders (model_type ouro" in described
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `rdepth import-hf`"))
    assert f"({shorts})" in row, row
