"""Row compaction of the static decode path (Decoder(compact=True)) equals predication and the
packed path, in float64 on the CPU, under every exit rule and both block types; padding a compacted
chunk with stopped rows (power-of-two buckets) changes nothing; bench/batched_exits.py runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rdepth.errors import RdepthError
from rdepth.exits.registry import POLICIES
from rdepth.model.noise import StateNoise
from rdepth.model.kv import AttentionContext
from rdepth.model.decoder import Decoder, StaticKV, StaticRows

from conftest import tiny_model
sys.path.insert(0, str(Path(__file__).parent))
from test_decoder import (  # noqa: E402
    K_MAX, PROMPT, controller_factory, decode_all, tokens, varied_setting)

ROOT = Path(__file__).resolve().parent.parent


def compacted_rows(decoder: Decoder) -> list[int]:
    """Record the row count of every compacted chunk the decoder runs (wraps its chunk function)."""
    sizes: list[int] = []
    run = decoder._compact_steps

    def recording(plan, group, steps, rows, order):
        sizes.append(rows)
        run(plan, group, steps, rows, order)

    decoder._compact_steps = recording
    return sizes


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("block", ["sandwich", "gpt2"])
@pytest.mark.parametrize("batch", [3, 8])
def test_compacted_equals_predicated_and_packed(name, block, batch):
    """Logits, steps computed and iterate handed on: compacted (exact row counts and power-of-two
    buckets) == predicated == teacher-forced packed evaluation under the same controller."""
    model = tiny_model(block)
    idx = tokens(batch)
    noise = StateNoise(1, range(batch))
    factory = controller_factory(model, name, varied_setting(model, idx, noise, name))
    forced = model(idx, controller=factory(), generator=noise)
    expected_computed, expected_used = torch.stack(forced.computed), torch.stack(forced.used)[:, :, PROMPT:]
    predicated = decode_all(Decoder(model, batch, K_MAX, controller_factory=factory, noise=noise,
                                          check_every=1), idx)
    for buckets in (False, True):
        decoder = Decoder(model, batch, K_MAX, controller_factory=factory, noise=noise, check_every=1,
                                compact=True, buckets=buckets)
        sizes = compacted_rows(decoder)
        logits, computed, used = decode_all(decoder, idx)
        torch.testing.assert_close(logits, forced.logits, rtol=0, atol=1e-10)
        assert torch.equal(computed, expected_computed) and torch.equal(used, expected_used)
        torch.testing.assert_close(logits, predicated[0], rtol=0, atol=1e-10)  # other row counts: other roundings
        assert torch.equal(computed, predicated[1]) and torch.equal(used, predicated[2])
        decoded = computed[:, :, PROMPT:]
        if not buckets and (decoded.min(dim=1).values < decoded.max(dim=1).values).any():  # rows stop apart
            assert min(sizes) < batch, "some chunk should run on fewer rows than the batch"
        if buckets:
            assert all(size & (size - 1) == 0 or size == batch for size in sizes)


@pytest.mark.parametrize("check_every", [1, 2, 3])
def test_compaction_at_every_chunk_length_and_the_hand_off(check_every):
    """Chunks of several steps (rows stop inside a chunk, are carried to its end, then dropped), and
    the two-hit rule that hands on x^(s-1): the state handed on, not only the indices, must match."""
    model = tiny_model("gpt2")
    batch = 8
    idx = tokens(batch)
    noise = StateNoise(2, range(batch))
    factory = controller_factory(model, "acceleration", varied_setting(model, idx, noise, "acceleration"))
    options = dict(controller_factory=factory, noise=noise, check_every=check_every)
    predicated = decode_all(Decoder(model, batch, K_MAX, **options), idx)
    decoder = Decoder(model, batch, K_MAX, compact=True, **options)
    compacted = decode_all(decoder, idx)
    torch.testing.assert_close(compacted[0], predicated[0], rtol=0, atol=1e-10)
    assert torch.equal(compacted[1], predicated[1]) and torch.equal(compacted[2], predicated[2])
    assert (compacted[2] < compacted[1][:, :, PROMPT:]).any(), "some token should hand on x^(s-1)"
    modes = {context.store.gather for context in decoder._row_contexts.values()}
    if check_every == 1:  # many chunks: some of few rows (copies read), some of many (the store in place)
        assert modes == {True, False}
    handed = decoder._handed.clone()  # the last token's hand-off of the last group
    reference = Decoder(model, batch, K_MAX, **options)
    decode_all(reference, idx)
    torch.testing.assert_close(handed, reference._handed, rtol=0, atol=1e-10)


def test_bucket_padding_with_stopped_rows_changes_nothing():
    """Run one chunk on the active rows only and on them padded with a stopped row: the active rows'
    states, hand-offs, counts and keys/values are the same (up to the rounding of a matmul over
    another row count); the padded stopped row keeps what it handed on."""
    model = tiny_model()
    batch = 8
    idx = tokens(batch)
    noise = StateNoise(3, range(batch))
    factory = controller_factory(model, "step_norm", varied_setting(model, idx, noise, "step_norm"))
    decoders = [Decoder(model, batch, K_MAX, controller_factory=factory, noise=noise, check_every=1,
                              compact=True) for _ in range(2)]
    active = torch.tensor([True, False, True, False, False, True, False, False])
    for decoder in decoders:
        decoder.prefill(idx[:, :PROMPT])
        decoder.tokens.copy_(idx[:, PROMPT:PROMPT + 1])
        decoder.cache.limit = decoder.length + 1  # as _advance sets it (eager: the written prefix)
        with torch.no_grad():
            decoder._begin_token()
            decoder._run_single((0,))
            decoder._begin_group(decoder._plan, 0)
            decoder._exit_steps(decoder._plan, 0, range(1, 2))
            decoder._active.copy_(active)  # three rows still loop
            decoder._order_rows()
    assert torch.equal(decoders[0]._order[:3], torch.tensor([0, 2, 5]))
    stopped_handed = decoders[1]._handed[~active].clone()
    with torch.no_grad():
        decoders[0]._compact_steps(decoders[0]._plan, 0, range(2, 3), 3, False)
        decoders[1]._compact_steps(decoders[1]._plan, 0, range(2, 3), 4, False)  # padded with stopped row 1
    exact, padded = decoders
    for name in ("_state", "_handed"):
        torch.testing.assert_close(getattr(exact, name)[active], getattr(padded, name)[active], rtol=0, atol=1e-12)
    assert torch.equal(exact.computed, padded.computed) and torch.equal(exact.used, padded.used)
    assert torch.equal(padded._handed[~active], stopped_handed)
    for layer in model.group_layers[0]:
        for a, b in zip(exact.cache.looped[layer], padded.cache.looped[layer]):
            torch.testing.assert_close(a[1, active, :, PROMPT], b[1, active, :, PROMPT], rtol=0, atol=1e-12)


def test_a_row_view_writes_only_its_rows_and_reads_the_store_in_place():
    model = tiny_model()
    cache = StaticKV(model, 4, 6, (2, 2), torch.float64, torch.device("cpu"))
    cache.position.fill_(3)
    single = cache.single[0][0]
    single.copy_(torch.randn_like(single))
    before = single.clone()
    rows = torch.tensor([3, 1])
    view = StaticRows(cache, rows)
    context = AttentionContext(view, 0, torch.arange(2), cache.position.expand(2), torch.zeros(2, dtype=torch.long),
                               1, 2, torch.ones(2, 1, 1, 6, dtype=torch.bool))
    keys = torch.randn(2, *single.shape[1:2], single.shape[3], dtype=torch.float64)
    read_k, _ = view.update(0, context, keys, keys)
    assert torch.equal(single[rows, :, 3], keys)
    untouched = torch.ones_like(single, dtype=torch.bool)
    untouched[rows, :, 3] = False
    assert torch.equal(single[untouched], before[untouched])
    assert read_k.data_ptr() == single.data_ptr() and read_k.shape == single.shape  # the store itself, no copy
    cache.limit = 4  # eager prefix reading: the written positions' view
    read_k, _ = view.update(0, context, keys, keys)
    assert read_k.data_ptr() == single.data_ptr() and read_k.shape[2] == 4
    gathered, _ = StaticRows(cache, rows, gather=True).update(0, context, keys, keys)  # few rows: copies
    assert torch.equal(gathered, single[rows, :, :4])


def test_compact_needs_exits_and_checks():
    model = tiny_model()
    noise = StateNoise(0, [0])
    with pytest.raises(RdepthError, match="compact=True needs exits"):
        Decoder(model, 1, K_MAX, noise=noise, compact=True)
    factory = controller_factory(model, "step_norm", 0.3)
    with pytest.raises(RdepthError, match="check_every"):
        Decoder(model, 1, K_MAX, noise=noise, controller_factory=factory, compact=True, check_every=None)


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
        assert set(row["settings"]) == {"a_full", "b_predicated", "c_compacted", "d_matched", "e_same_quality"}
        settings = row["settings"]
        assert settings["a_full"]["agreement"] == 1.0
        assert settings["b_predicated"]["mean_steps"] == settings["c_compacted"]["mean_steps"]
        assert settings["b_predicated"]["agreement"] == settings["c_compacted"]["agreement"]
    assert report["settings"]["tau"] in (1e-3, 10.0) and "torch" in report["environment"]
    assert "device:" in done.stdout


def test_bench_conditional_rows_run_and_a_failing_one_leaves_the_others(tmp_path, monkeypatch, capsys):
    """--conditional adds (h) the exits with no host check, (i) the fixed budget of their executed steps
    and (j) the conditional quantile exits, with (h) as many mean steps as (b); a conditional setting that
    cannot run (here: every decoder asked for conditional steps fails) is recorded and the rest still run."""
    import importlib.util

    from rdepth.model import decoder as decoder_module

    spec = importlib.util.spec_from_file_location("batched_exits_bench", ROOT / "bench" / "batched_exits.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--preset", "tiny", "--batches", "3", "--prompt", "3", "--tokens", "3", "--k-max", "3", "--policy",
            "step_norm", "--tau", "0.3", "--check-every", "1", "--quantile", "0.5", "--conditional", "--warmup", "0",
            "--repeats", "1", "--threads", "1"]
    out = tmp_path / "ok.json"
    assert bench.main([*argv, "--json", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert {"h_conditional", "i_executed", "j_conditional_quantile_0.5"} <= set(row["settings"]) and not row["failed"]
    settings = row["settings"]
    assert settings["h_conditional"]["mean_steps"] == settings["b_predicated"]["mean_steps"]
    assert settings["i_executed"]["budget"] == [min(max(round(s), 1), 3) for s in
                                                settings["h_conditional"]["slowest_row_steps"]]

    real = decoder_module.Decoder

    class NoConditional(real):
        def __init__(self, *args, conditional=False, **kwargs):
            if conditional:
                raise RuntimeError("no conditional nodes here")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(decoder_module, "Decoder", NoConditional)
    out = tmp_path / "failed.json"
    assert bench.main([*argv, "--json", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert set(row["failed"]) == {"h_conditional", "j_conditional_quantile_0.5"}
    assert "i_executed" not in row["settings"] and {"a_full", "b_predicated", "d_matched"} <= set(row["settings"])
    assert "h_conditional could not run: RuntimeError: no conditional nodes here" in capsys.readouterr().err


def test_a_compacted_token_syncs_once_per_check():
    """The compaction reads the active count at the checks it already had, and nothing more."""
    from test_decoder import SYNC_OPS, op_counts

    model = tiny_model()
    batch = 8
    idx = tokens(batch)
    noise = StateNoise(5, range(batch))
    factory = controller_factory(model, "step_norm", varied_setting(model, idx, noise, "step_norm"))
    decoder = Decoder(model, batch, K_MAX, controller_factory=factory, noise=noise, check_every=2, compact=True)
    decoder.prefill(idx[:, :PROMPT])
    counts = op_counts(lambda: decoder.step(idx[:, PROMPT:PROMPT + 1]))
    checks = sum(1 for kind, _ in decoder._plan.pieces if kind == "check")
    assert counts.get("aten::nonzero", 0) == 0
    assert 0 < sum(counts.get(op, 0) for op in SYNC_OPS) <= checks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("check_every", [1, 2])
def test_captured_compaction_with_buckets_equals_eager(check_every):
    """CUDA graphs of every power-of-two row count, replayed by the active count: the logits and steps
    of eager compacted (exact counts) and eager predicated decoding."""
    model = tiny_model().cuda()
    batch = 8
    idx = tokens(batch).cuda()
    noise = StateNoise(8, range(batch))
    factory = controller_factory(model, "step_norm", varied_setting(model, idx, noise, "step_norm"))
    options = dict(controller_factory=factory, noise=noise, check_every=check_every)
    predicated = decode_all(Decoder(model, batch, K_MAX, **options), idx)
    eager = decode_all(Decoder(model, batch, K_MAX, compact=True, **options), idx)
    decoder = Decoder(model, batch, K_MAX, compact=True, **options)
    sizes = compacted_rows(decoder)
    decoder.prefill(idx[:, :PROMPT])
    decoder.capture()
    sizes.clear()  # capture ran every size
    assert set(decoder._bucket_sizes()) == {1, 2, 4, 8}
    logits, computed = [], []
    for t in range(PROMPT, idx.shape[1]):
        logits.append(decoder.step(idx[:, t:t + 1]))
        computed.append(decoder.computed.clone())
    logits, computed = torch.stack(logits, 1), torch.stack(computed, 2)
    for reference in (predicated, eager):
        torch.testing.assert_close(logits, reference[0][:, PROMPT:], rtol=0, atol=1e-10)
        assert torch.equal(computed, reference[1][:, :, PROMPT:])
    assert not sizes  # replayed graphs: the eager chunk function never ran after capture
