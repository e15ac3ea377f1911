"""Batched exits of the decoder (predicated: every row computes every step of a chunk, a stopped row
keeps its hand-off) equal the packed path, in float64 on the CPU, under every exit rule and both block
types, at every chunk length; bench/batched_exits.py runs. (Row compaction, ``compact=True``, was removed:
on an H200 it was slower than predication at every batch, docs/results.md.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from rdepth.exits.registry import POLICIES
from rdepth.model.noise import StateNoise

sys.path.insert(0, str(Path(__file__).parent))
from test_decoder import PROMPT, controller_factory, decode_all, make, tokens, varied_setting  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("block", ["sandwich", "gpt2"])
@pytest.mark.parametrize("batch", [3, 8])
def test_predicated_equals_packed(name, block, batch):
    """Logits, steps computed and iterate handed on: predicated == teacher-forced packed evaluation under
    the same controller."""
    model = tiny_model(block)
    idx = tokens(batch)
    noise = StateNoise(1, range(batch))
    factory = controller_factory(model, name, varied_setting(model, idx, noise, name))
    forced = model(idx, controller=factory(), noise=noise)
    expected_computed, expected_used = torch.stack(forced.computed), torch.stack(forced.used)[:, :, PROMPT:]
    logits, computed, used = decode_all(make(model, batch, controller_factory=factory, noise=noise, check_every=1),
                                        idx)
    torch.testing.assert_close(logits, forced.logits, rtol=0, atol=1e-10)
    assert torch.equal(computed, expected_computed) and torch.equal(used, expected_used)


@pytest.mark.parametrize("check_every", [1, 2, 3])
def test_every_chunk_length_hands_on_the_same_state(check_every):
    """Chunks of several steps (rows stop inside a chunk and are carried to its end), and the two-hit rule
    that hands on x^(s-1): the state handed on, not only the indices, must match the unchecked run."""
    model = tiny_model("gpt2")
    batch = 8
    idx = tokens(batch)
    noise = StateNoise(2, range(batch))
    factory = controller_factory(model, "acceleration", varied_setting(model, idx, noise, "acceleration"))
    decoder = make(model, batch, controller_factory=factory, noise=noise, check_every=check_every)
    chunked = decode_all(decoder, idx)
    reference = make(model, batch, controller_factory=factory, noise=noise, check_every=None)
    unchecked = decode_all(reference, idx)
    torch.testing.assert_close(chunked[0], unchecked[0], rtol=0, atol=1e-10)
    assert torch.equal(chunked[1], unchecked[1]) and torch.equal(chunked[2], unchecked[2])
    assert (chunked[2] < chunked[1][:, :, PROMPT:]).any(), "some token should hand on x^(s-1)"
    torch.testing.assert_close(decoder._handed, reference._handed, rtol=0, atol=1e-10)


def test_bench_batched_exits_runs(tmp_path):
    """A smoke run of the benchmark on a tiny random model: it writes every setting's numbers."""
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "bench" / "batched_exits.py"), "--preset", "tiny", "--batches", "2,4",
               "--prompt", "3", "--tokens", "3", "--k-max", "2", "--policy", "step_norm", "--tau", "1e-3,10",
               "--check-every", "1", "--warmup", "0", "--repeats", "1", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [row["batch"] for row in report["results"]] == [2, 4]
    for row in report["results"]:
        assert set(row["settings"]) == {"a_full", "b_predicated", "d_matched", "e_same_quality"}
        assert row["settings"]["a_full"]["agreement"] == 1.0
    assert report["settings"]["tau"] in (1e-3, 10.0) and "torch" in report["environment"]
    assert "device:" in done.stdout
