"""What the looped-model command tests share (tests/test_looped_hrm_text.py, tests/test_looped_inkling2.py): a text
both read, the windows the commands cut from it, the golden numbers of a geometry summary and their check."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import torch

GOLDEN = Path(__file__).parent / "golden"
# ASCII, so the byte tokenizer's ids are the characters' codes; long enough for a few windows of 16 tokens.
TEXT = " ".join(f"loop {i} turns {i * 7 % 13} and hands on {i * 5 % 11}." for i in range(40))


def write_text(folder: Path) -> Path:
    path = folder / "text.txt"
    path.write_text(TEXT)
    return path


def text_windows(seq_len: int, count: int) -> torch.Tensor:
    """The windows the commands cut from :data:`TEXT` (the byte tokenizer: ids are the UTF-8 bytes)."""
    from rdepth.run.heldout import held_out_windows

    return held_out_windows(np.frombuffer(TEXT.encode(), dtype=np.uint8).astype(np.int64), seq_len, count)


def weights_digest(model) -> str:
    """SHA-256 of the model's parameters (sorted names, float32 bytes): the writer still makes the golden model."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def golden_numbers(summary: dict) -> dict:
    """The headline numbers of a looped geometry summary's last folder: the loss, per loop run the mean step
    sizes, relative step sizes, cosines and effective ranks, per boundary the DLR and hand-off medians and the
    zero-drift control's median."""
    budget = summary["checkpoints"][-1]["budgets"]["train"]
    groups = {group["name"]: {metric: group[metric]["mean"] for metric in ("step_size", "relative_step_size", "cosine")}
              | {"effective_rank": group["effective_rank"]} for group in budget["groups"]}
    boundaries = {name: {definition: definitions[definition]["median"]
                         for definition in ("literal", "first", "first_refine", "output", "handoff")}
                  | {"handoff_control": budget["handoff_control"][name]["median"]}
                  for name, definitions in budget["dlr"].items()}
    return {"loss": budget["loss"], "groups": groups, "boundaries": boundaries}


def _flat(value, prefix=""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flat(item, f"{prefix}/{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _flat(item, f"{prefix}[{index}]")
    else:
        yield prefix, value


def check_golden(name: str, numbers: dict, digest: str, about: str, write: bool = False) -> None:
    """Compare ``numbers`` with ``tests/golden/NAME.json`` (relative 1e-7: float64 sums in another order move the
    last digits only; 1e-5 for effective ranks); ``write``: (re)write the file instead."""
    path = GOLDEN / f"{name}.json"
    if write:
        path.write_text(json.dumps({"about": about, "weights_sha256": digest, "numbers": numbers}, indent=1) + "\n")
        return
    golden = json.loads(path.read_text())
    assert golden["weights_sha256"] == digest, "the writer no longer makes the golden model"
    expected, got = dict(_flat(golden["numbers"])), dict(_flat(numbers))
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        if value is None or got[key] is None:
            assert value == got[key], key
        else:  # the effective rank's Gram matrix is summed in float32 (rdepth.geometry.stream): looser there
            tolerance = 1e-5 if "effective_rank" in key else 1e-7
            assert math.isclose(got[key], value, rel_tol=tolerance, abs_tol=1e-12), (key, got[key], value)
