"""An exported folder on older transformers releases: the same logits and tokens as rdepth's.

``.ci/run`` builds one venv per release in ``tests/hf_venvs.py`` (4.46.3, 4.57.6, 5.0.0; the
newest, the project's pin, is the system's and is tested in ``test_hf_export.py``). Each test runs
``tests/hf_probe.py`` in one venv, where rdepth cannot be imported, and compares what it saved with
rdepth's own model. A venv that is not there is skipped (``python tests/hf_venvs.py`` makes them).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from rdepth.model.generation import generate
from rdepth.model.noise import StateNoise

transformers = pytest.importorskip("transformers")

import hf_probe  # noqa: E402
import hf_venvs  # noqa: E402
from test_hf_helpers import tiny_run, tiny_tokenizer  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    """A tiny three-group run, exported, and what rdepth's own model gives on the probe's prompts."""
    from rdepth.interop.config import ExportConfig
    from rdepth.interop.export import export_run

    root = tmp_path_factory.mktemp("versions")
    run, model = tiny_run(root / "run", groups="1|2-3|4", n_layer=6)
    out = export_run(ExportConfig(checkpoint=str(run), out=str(root / "hf")))
    ids = [tiny_tokenizer().encode(prompt) for prompt in hf_probe.PROMPTS]
    first = torch.tensor([ids[0]])
    with torch.no_grad():
        logits = {c: model(first, loop_counts=c, noise=StateNoise(0, [0])).logits for c in hf_probe.BUDGETS}
        last = []
        hook = model.norm_f.register_forward_hook(lambda module, inputs, output: last.append(output))
        model(first, loop_counts=(3, 2, 5), noise=StateNoise(0, [0]))  # the head's input, as the probe reads it
        hook.remove()
        greedy = {c: generate(model, first, hf_probe.NEW, temperature=0, loop_counts=c,
                              noise=StateNoise(0, [0])).tolist() for c in hf_probe.BUDGETS}
        alone = [generate(model, torch.tensor([row]), hf_probe.NEW, temperature=0, loop_counts=(3, 2, 5),
                          noise=StateNoise(0, [0]))[0].tolist() for row in ids]
    return {"folder": out, "root": root, "ids": ids, "logits": logits, "greedy": greedy, "alone": alone,
            "hidden": last[0],
            "vocab": model.config.vocab_size, "block_size": model.config.block_size}


def test_export_runs_identically_on_the_newest_transformers(expected):
    """The probe in this process, on the project's pinned (newest) release."""
    check(hf_probe.probe(str(expected["folder"])), expected, transformers.__version__)


@pytest.mark.parametrize("name", list(hf_venvs.VENVS))
def test_export_runs_identically_on_an_older_transformers(expected, name):
    folder = hf_venvs.venv_dir() / name
    if not hf_venvs.ready(folder, hf_venvs.VENVS[name]):
        pytest.skip(f"no venv {folder} (python tests/hf_venvs.py builds it; .ci/run does)")
    out = expected["root"] / f"{name}.pt"
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(expected["root"] / f"modules-{name}")}
    done = subprocess.run([str(hf_venvs.python_of(folder)), str(HERE / "hf_probe.py"), str(expected["folder"]),
                           str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # the venv's own release ran, not the system's
    check(torch.load(out, weights_only=False), expected, hf_venvs.VENVS[name][0].split("==")[1])


def check(got: dict, expected: dict, version: str) -> None:
    """What the probe saw equals rdepth's own model (logits bit for bit, tokens exactly)."""
    assert got["version"] == version
    assert got["ids"] == expected["ids"]
    assert got["tied"] and got["pad_token"] == "<|pad|>" and got["padding_side"] == "left"
    # the pad is its own token, one past the model's vocabulary, which transformers' vocabulary counts (issue 43)
    vocab = expected["vocab"]
    special = got["special"]
    assert special["pad"] == special["generation_pad"] == special["tokenizer_pad"] == vocab != special["eos"]
    assert special["vocab"] == special["tokenizer_length"] == vocab + 1
    assert got["mask_warnings"] == []  # transformers infers the attention mask from the pads
    for counts in hf_probe.BUDGETS:
        # the real vocabulary bit for bit; the pad's column -inf (softmax over the real columns unchanged)
        logits = got["logits"][counts]
        assert torch.equal(logits[..., :vocab], expected["logits"][counts]), counts
        assert logits.shape[-1] == vocab + 1 and torch.isneginf(logits[..., vocab]).all()
        assert got["greedy"][counts] == expected["greedy"][counts], counts
    hidden, loop_shapes = got["hidden"]  # output_hidden_states: the head's input, and every iterate
    assert torch.equal(hidden, expected["hidden"]) and loop_shapes == [(4, 1, hidden.shape[1], hidden.shape[2]),
                                                                       (3, 1, hidden.shape[1], hidden.shape[2]),
                                                                       (6, 1, hidden.shape[1], hidden.shape[2])]
    # issue 55: generate's hidden states per step (None on 4.57 and 5.x before), with the cache and without
    cached, uncached = got["generate_hidden"][True], got["generate_hidden"][False]
    assert len(cached) == len(uncached) == 3 and all(step is not None for step in cached + uncached)
    for a, b in zip(cached, uncached, strict=False):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(cached[0], expected["hidden"][:, -1], rtol=0, atol=1e-6)
    (plain_loss, plain_grad), (loss, grad) = got["checkpointing"]  # gradient checkpointing: the same gradients
    assert loss == plain_loss and torch.allclose(grad, plain_grad, rtol=0, atol=1e-6)
    assert got["sdpa"] and got["max_length"] == expected["block_size"]
    # transformers' own loop, with rdepth's cache and without: the decoder's tokens
    assert got["hf_loop_cached"] == got["hf_loop_uncached"] == expected["greedy"][(3, 2, 5)]
    # one left-padded batch: every row's tokens are its unpadded generation's, after its pads
    width = max(len(row) for row in expected["ids"])
    for row, mask, alone in zip(got["left_padded"], got["left_padded_mask"], expected["alone"], strict=False):
        pads = width - sum(mask)
        assert row[pads:] == alone and mask[:pads] == [0] * pads
    torch.testing.assert_close(got["padded_logits"][0, :, :vocab], expected["logits"][(3, 2, 5)][0])
    # repetition_penalty (transformers' loop, which penalises every input id, pads included): every left-padded
    # row's tokens and real-vocabulary scores are its prompt's alone (with pad = eos they were not, on 4.46-5.0)
    for key in ("penalised", "penalised_cached"):  # uncached, and through rdepth's cache with left pads
        tokens, scores = got[key]
        for row, (tokens_alone, scores_alone) in enumerate(got["penalised_alone"]):
            assert tokens[row] == tokens_alone[0], (key, row)
            for step, step_alone in zip(scores, scores_alone, strict=False):
                torch.testing.assert_close(step[row, :vocab], step_alone[0, :vocab], rtol=1e-5, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(expected["folder"])
    assert got["pipeline"] == [tokenizer.decode(alone) for alone in expected["alone"]]
    assert f"block_size = {expected['block_size']}" in got["too_long"]
    resized = got["resized"]
    assert resized["width"] == expected["vocab"] + 1 and resized["reloads_equal"]
    assert math.isfinite(resized["loss"]) and resized["old_columns_diff"] < 1e-6


def test_older_transformers_gets_one_line_naming_the_range(monkeypatch):
    from rdepth.interop.source import config_source

    # an old release, as configuration_rdepth.py's "import transformers" sees it
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="4.40.2"))
    with pytest.raises(ImportError) as error:
        exec(compile(config_source(), "configuration_rdepth.py", "exec"), {"__name__": "configuration_rdepth"})
    message = str(error.value)
    assert "\n" not in message and "transformers >= 4.46" in message and "4.40.2" in message


def test_the_stated_range_names_every_tested_release():
    from rdepth.interop.hf_config import TESTED_RANGE

    for pins in hf_venvs.VENVS.values():
        assert pins[0].split("==")[1] in TESTED_RANGE
    assert transformers.__version__ in TESTED_RANGE  # the project's pin, the newest tested
