"""``scripts/vit_stochastic_depth.py --merge``: runs of another study folder join OUT's, settings checked."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "vit_stochastic_depth.py"


def load_script():
    spec = importlib.util.spec_from_file_location("vit_stochastic_depth", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def study(folder: Path, seeds: list[int], **changed) -> None:
    folder.mkdir()
    args = {"seeds": ",".join(map(str, seeds)), "out": str(folder), "threads": 1, "epochs": 1, "k": 2, **changed}
    records = [{"tag": f"sd0.0_seed{seed}", "value": seed} for seed in seeds]
    for record in records:
        np.savez(folder / f"similarity_{record['tag']}.npz", token_cosine=np.full((2, 2), record["value"]))
    (folder / "results.json").write_text(json.dumps({"args": args, "records": records, "seconds": 10.0 + len(seeds),
                                                     "environment": {"host": folder.name}}))


def test_merge_adds_new_runs_once_and_refuses_other_settings(tmp_path):
    script = load_script()
    study(tmp_path / "a", [0, 1])
    study(tmp_path / "b", [1, 2])
    merged = script.merge_study(tmp_path / "a", tmp_path / "b")
    assert [r["tag"] for r in merged["records"]] == ["sd0.0_seed0", "sd0.0_seed1", "sd0.0_seed2"]
    assert merged["records"][1]["value"] == 1  # a run already in OUT is kept, not replaced
    assert merged["merged"][0]["runs"] == ["sd0.0_seed2"] and merged["merged"][0]["seconds"] == 12.0
    with np.load(tmp_path / "a" / "similarity_sd0.0_seed2.npz") as data:
        assert float(data["token_cosine"][0, 0]) == 2.0
    study(tmp_path / "c", [3], epochs=2)
    with pytest.raises(SystemExit, match="other settings \\(epochs\\)"):
        script.merge_study(tmp_path / "a", tmp_path / "c")
