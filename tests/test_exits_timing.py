"""Robust timing: interleaved rounds, median and IQR, the noise rule, and where the flags surface.

Everything here uses constructed timings (no wall clock is asserted on)."""

from __future__ import annotations

import pytest
import torch

from rdepth.config import get_preset
from rdepth.errors import RdepthError
from rdepth.model import RecurrentLM
from rdepth.sweep.report import write_report_section
from rdepth.sweep.stats import compare, format_ratio, quartiles, spread
from rdepth.sweep.summary import matched_quality, packed_over_dense, summarize
from rdepth.sweep.timing import generate_call, time_interleaved

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ statistics and the noise rule

def test_quartiles_and_spread_by_hand():
    assert quartiles([4.0]) == (4.0, 4.0, 4.0)
    assert quartiles([5.0, 1.0, 3.0, 2.0, 4.0]) == (2.0, 3.0, 4.0)  # order does not matter
    stats = spread([1.0, 2.0, 3.0, 4.0, 5.0])
    assert stats == {"median": 3.0, "iqr": [2.0, 4.0], "rel_iqr": pytest.approx(2.0 / 3.0)}
    with pytest.raises(RdepthError, match="empty"):
        quartiles([])


def test_a_resolved_speedup_is_not_flagged():
    # reference 2.0 ms [1.95, 2.05], candidate 1.0 ms [0.98, 1.02]: tight and far apart.
    result = compare((2.0, [1.95, 2.05]), (1.0, [0.98, 1.02]), threshold=0.10)
    assert result["ratio"] == pytest.approx(2.0)
    assert result["range"] == [pytest.approx(1.95 / 1.02), pytest.approx(2.05 / 0.98)]
    assert result["noise"] is None
    assert format_ratio(result) == "2x [1.91-2.09]"


def test_overlapping_iqrs_are_within_noise():
    result = compare((1.05, [1.00, 1.10]), (1.00, [0.97, 1.03]), threshold=0.5)
    assert result["noise"] == "IQRs overlap"
    assert "within noise: IQRs overlap" in format_ratio(result)


def test_a_wide_spread_is_within_noise_even_when_the_iqrs_are_apart():
    # The case: the reference timed during a burst of load (wide IQR), the candidate tight.
    result = compare((6.0, [3.0, 9.0]), (1.0, [0.99, 1.01]), threshold=0.10)
    assert result["ratio"] == pytest.approx(6.0)
    assert result["noise"] == "spread 100.0% > 10%"
    both = compare((1.0, [0.5, 1.5]), (1.0, [0.9, 1.1]), threshold=0.10)
    assert both["noise"] == "IQRs overlap; spread 100.0% > 10%"
    assert compare((2.0, [1.875, 2.0625]), (1.0, [0.953125, 1.046875]), threshold=0.10)["noise"] is None  # 9.4%
    with pytest.raises(RdepthError, match="positive"):
        compare((0.0, [0.0, 0.0]), (1.0, [1.0, 1.0]))


# ------------------------------------------------------------------ interleaved rounds

def test_rounds_time_every_setting_once_in_a_shuffled_order():
    calls: list[str] = []
    labels = [f"setting{i}" for i in range(6)]
    samples = time_interleaved({label: (lambda label=label: calls.append(label)) for label in labels}, "cpu",
                               warmup=2, repeats=4, seed=3)
    warm, timed = calls[:12], calls[12:]
    assert warm == [label for label in labels for _ in range(2)]  # each warmed up, untimed
    rounds = [timed[i * 6:(i + 1) * 6] for i in range(4)]
    assert all(sorted(r) == labels for r in rounds)  # every round times every setting once
    assert len({tuple(r) for r in rounds}) > 1  # ... not always in the same order
    assert set(samples) == set(labels) and all(len(s) == 4 and min(s) >= 0 for s in samples.values())
    again: list[str] = []
    time_interleaved({label: (lambda label=label: again.append(label)) for label in labels}, "cpu",
                     warmup=2, repeats=4, seed=3)
    assert again == calls  # the order is seeded
    with pytest.raises(RdepthError, match="repeats"):
        time_interleaved({"a": lambda: None}, "cpu", repeats=0)


class _AutocastProbe(RecurrentLM):
    """Records whether autocast was on at each readout (the decoder reads out once per pass)."""

    seen: list

    def readout(self, *args, **kwargs):
        self.seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
        return super().readout(*args, **kwargs)


def test_generation_is_timed_under_the_sweeps_autocast():
    torch.manual_seed(0)
    model = _AutocastProbe(get_preset("tiny", n_layer=2, d_model=16, n_head=2, block_size=12, vocab_size=40,
                                      groups="1")).eval()
    model.seen = []
    prompt = torch.randint(0, 40, (1, 4))
    generate_call(model, prompt, 3, loop_counts=[2], autocast_dtype=torch.bfloat16)()
    assert model.seen == [torch.bfloat16] * 3  # the prompt's pass and two single-token steps
    model.seen = []
    generate_call(model, prompt, 3, loop_counts=[2])()
    assert model.seen == [False] * 3


# ------------------------------------------------------------------ the summary's flags, from constructed timings

def _entry(ppl, steps, packed, dense=None, spread_=0.02):
    """A measured entry with median timings and IQRs of +-spread_ around them."""
    entry = {"ppl": ppl, "ce": 0.0, "mean_steps": steps, "mean_used": steps, "tokens": 64,
             "computed_histogram": [[0] * 9 for _ in steps], "timing_path": "packed"}
    for key, value in {"ms_per_token_b1": packed, **({"dense_ms_per_token_b1": dense} if dense else {})}.items():
        entry[key] = value
        entry[f"{key}_iqr"] = [value * (1 - spread_), value * (1 + spread_)]
    return entry


def _result(full_spread=0.02):
    reference = {"budget": [8, 8], **_entry(100.0, [8, 8], packed=2.0, dense=1.6, spread_=full_spread)}
    ladder = [{"budget": [k, k], **_entry(100.0 + 3 * (8 - k), [k, k], packed=k / 4, dense=k / 5)}
              for k in range(1, 9)]
    ladder[-1] = reference

    def point(policy, value, ppl, steps, ms, spread_=0.02):
        base = {"budget": [round(s) for s in steps], **_entry(ppl * 1.1, steps, packed=ms, dense=ms * 0.8)}
        return {"policy": policy, "parameter": "tau", "value": value, **_entry(ppl, steps, ms, spread_=spread_),
                "baseline": base}

    points = [
        point("step_norm", 1e-2, 100.5, [4, 4], 1.0),  # resolved: 2.0 vs 1.0
        point("kl", 1e-2, 100.2, [7, 7], 1.96),  # IQRs overlap with the full budget's
        point("cosine", 1e-2, 100.4, [5, 5], 1.2, spread_=0.4),  # its own spread is too wide
    ]
    return {"k_max": [8, 8], "reference": reference, "fixed_ladder": ladder, "points": points,
            "config": {"repeats": 5, "warmup": 2, "decode": "head", "kl_direction": "new_old"},
            "environment": {"device": "cpu"}}


def test_speedups_carry_their_range_and_noise_flag():
    rows = {row["policy"]: row for row in matched_quality(_result(), 0.01, "b1", noise_threshold=0.1)}
    step = rows["step_norm"]
    assert step["speedup_vs_full_b1"] == pytest.approx(2.0) and step["speedup_vs_full_b1_noise"] is None
    assert step["speedup_vs_full_b1_range"] == [pytest.approx(1.96 / 1.02), pytest.approx(2.04 / 0.98)]
    # The same budget on the dense path is a separate reference, never the speedup's baseline.
    assert step["speedup_vs_dense_full_b1"] == pytest.approx(1.6)
    assert rows["kl"]["speedup_vs_full_b1_noise"] == "IQRs overlap"
    assert rows["cosine"]["speedup_vs_full_b1_noise"].startswith("spread 80.0%")
    assert step["matched_fixed_budget"] == [8, 8]  # every shorter fixed budget loses >= 3 ppl


def test_summary_saves_the_flags_and_the_warnings():
    summary = summarize(_result(), 0.01, noise_threshold=0.1)
    assert summary["noise_threshold"] == 0.1 and summary["noisy"] is True
    warnings = summary["noise_warnings"]
    assert len(warnings) == 2  # kl and cosine vs the full budget; vs fixed is the same budget here
    assert warnings[0].startswith("kl (tau=0.01): speedup over the full budget (teacher-forced, batch 1) 1.02x")
    assert "within noise: IQRs overlap" in warnings[0] and "cosine (tau=0.01)" in warnings[1]
    assert summary["timing_path"] == "packed"
    assert set(summary["latency_definitions"]) == {"ms_per_token_b1", "dense_ms_per_token_b1"}
    assert "not decode latency" in summary["latency_definitions"]["ms_per_token_b1"]
    assert summary["best"]["policy"] == "step_norm"
    # A reference timed during a burst of load is itself a warning.
    noisy_reference = summarize(_result(full_spread=0.3), 0.01, noise_threshold=0.1)["noise_warnings"]
    assert noisy_reference[0].startswith("the full budget's ms_per_token_b1 varies by 60.0%")
    quiet = summarize(_result(), 0.01, noise_threshold=10.0)  # a huge threshold leaves only the overlap
    assert [w.split(":")[0] for w in quiet["noise_warnings"]] == ["kl (tau=0.01)"]


def test_packed_over_dense_for_identical_work():
    rows = packed_over_dense(_result(), 0.1)
    assert [row["budget"] for row in rows][:3] == [[1, 1], [2, 2], [3, 3]]
    full = next(row for row in rows if row["budget"] == [8, 8])
    assert full["b1"]["ratio"] == pytest.approx(2.0 / 1.6)  # packed / dense: > 1, packed slower
    assert full["b1"]["noise"] is None
    assert next(row for row in rows if row["budget"] == [4, 4])["b1"]["ratio"] == pytest.approx(1.25)


def test_report_section_shows_the_warning_and_the_path(tmp_path):
    result = _result()
    result["summary"] = summarize(result, 0.01, noise_threshold=0.1)
    page = write_report_section(result, tmp_path, {}).read_text()
    assert "WARNING: 2 timing comparison(s) below are within noise" in page
    assert "kl (tau=0.01): speedup over the full budget" in page
    assert "teacher-forced ms/token" in page.lower() and "not decode latency" in page
    assert "same (packed) path" in page and "packed / dense time" in page
    assert "decode = head" in page and "KL(p_new || p_old), the paper&#x27;s Eq. 4" in page
    quiet = _result()
    quiet["points"] = quiet["points"][:1]
    quiet["summary"] = summarize(quiet, 0.01, noise_threshold=0.1)
    assert "WARNING" not in write_report_section(quiet, tmp_path / "quiet", {}).read_text()


def test_cli_prints_the_path_and_a_warning_per_noisy_ratio(monkeypatch, capsys):
    import rdepth.sweep.run as sweep_module
    from rdepth.cli.main import main

    result = _result()
    result["summary"] = summarize(result, 0.01, noise_threshold=0.1)
    monkeypatch.setattr(sweep_module, "sweep_checkpoint",
                        lambda config: {**result, "paths": {"json": "o/sweep.json", "report": "o/index.html"}})
    assert main(["sweep", "--checkpoint", "c", "--data", "d", "--out", "o"]) == 0
    printed = capsys.readouterr().out
    assert "teacher-forced ms/token at batch 1" in printed and "same packed path" in printed
    assert "step_norm: value 0.01" in printed and "2x [1.92-2.08] the full budget's speed" in printed
    assert printed.count("WARNING (timing noise)") == 2
    assert "packed / dense path, identical work (full budget, batch 1): 1.25x" in printed
