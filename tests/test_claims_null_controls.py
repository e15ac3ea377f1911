"""Claims 1-3 judged on loops of known dynamics (rdepth.geometry.synthetic): each judge says "not
reproduced" on a constructed case where its claim is false and "reproduced" where it holds, through the
real path (observer -> saved summary -> judge)."""

from __future__ import annotations

import math

import pytest

from rdepth.cli.main import main
from rdepth.errors import RdepthError
from rdepth.geometry.metrics import drift_to_loop_ratio, handoff_ratio
from rdepth.geometry.stream import GeometryObserver
from rdepth.geometry.summary import (
    HANDOFF_CONTROL,
    checkpoint_entry,
    noise_floor_step,
    settled_window,
    summarize_budget,
)
from rdepth.geometry.synthetic import LoopDynamics, dynamics_from_curves, observe, trajectories
from rdepth.reproduce import claims as C

NAMES = ["4", "5-6", "7"]
SPIRAL = math.acos(0.58)  # consecutive steps at cosine 0.58: inside the paper's band


def summary_of(checkpoints: list[list[LoopDynamics]], steps: int, drift: float) -> dict:
    """A geometry summary of synthetic loops: one checkpoint per entry of ``checkpoints`` (one
    LoopDynamics per group), every group run ``steps`` steps, fixed points ``drift`` apart."""
    entries = []
    for index, groups in enumerate(checkpoints):
        observer = GeometryObserver(rank=False, keep_sequence=None)
        observe(observer, trajectories(groups, steps, drift, seed=index))
        budget = {"loop_counts": [steps] * len(groups),
                  **summarize_budget(observer.result(), NAMES[:len(groups)], None)}
        entries.append(checkpoint_entry(f"step_{100 * (index + 1):06d}", 100 * (index + 1), "synthetic",
                                        {"train": budget, "long": budget}))
    return {"checkpoints": entries, "scale_budget": "long", "groups": NAMES[:len(checkpoints[0])],
            "dlr_default_refine": "first_refine"}


def loops(contraction: float, rotation: float = SPIRAL, noise: float = 30.0, groups: int = 3) -> list[LoopDynamics]:
    return [LoopDynamics(contraction, rotation, noise)] * groups


# ------------------------------------------------------------------ claim 3: drift that is drift


@pytest.mark.parametrize("steps", [6, 12, 30])
def test_zero_drift_is_not_reproduced_at_any_budget(steps):
    summary = summary_of([loops(0.6)], steps, drift=0.0)
    claim = C.claim_dlr(summary)
    assert claim["verdict"] == C.NOT
    for row in claim["ours"]["boundaries"]:
        assert row["handoff_median"] < 0.1  # ~0: the groups settle where the last one did
        assert row["control_median"] == pytest.approx(row["handoff_median"], rel=0.5, abs=1e-3)
        assert row["eq2_median"] > 1  # Eq. 2 reads the random start, reported beside it, not judged


@pytest.mark.parametrize("steps", [6, 12, 30])
def test_large_drift_is_reproduced_at_any_budget(steps):
    summary = summary_of([loops(0.6, noise=3.0)], steps, drift=100.0)
    claim = C.claim_dlr(summary)
    assert claim["verdict"] == C.REPRODUCED
    assert all(row["handoff_median"] >= max(10, C.CONTROL_MARGIN * row["control_median"])
               for row in claim["ours"]["boundaries"])


def test_moderate_drift_is_partly():
    claim = C.claim_dlr(summary_of([loops(0.6, noise=3.0)], 12, drift=8.0))
    assert claim["verdict"] == C.PARTLY
    assert all(1 < row["handoff_median"] < 10 for row in claim["ours"]["boundaries"])


def test_handoff_ratio_reads_drift_not_the_budget_or_the_noise():
    """On the reviewer's construction Eq. 2 reads the same whatever the drift and grows with K; the hand-off
    ratio is ~0 without drift, grows with it, and does not move with K."""
    group = LoopDynamics(0.6, SPIRAL, 30.0)
    readings = {}
    for steps in (12, 30):
        for drift in (0.0, 5.0, 20.0):
            first, second = trajectories([group, group], steps, drift)
            readings[steps, drift] = (float(handoff_ratio(first, second).median()),
                                      float(drift_to_loop_ratio(first, second, "literal").median()))
    for drift in (5.0, 20.0):
        assert readings[12, drift][0] == pytest.approx(readings[30, drift][0], rel=0.02)  # K-free
        assert readings[30, drift][1] > 2 * readings[12, drift][1]  # Eq. 2 grows with K
    assert readings[12, 0.0][0] < 0.01 and readings[30, 0.0][0] < 1e-5
    assert readings[12, 20.0][0] > 3 * readings[12, 5.0][0] > 3 * readings[12, 0.0][0]


def test_the_stream_measures_the_handoff_ratio_exactly():
    group = LoopDynamics(0.7, SPIRAL, 10.0)
    first, second = trajectories([group, group], 9, 4.0)
    observer = GeometryObserver(rank=False, keep_sequence=None)
    observe(observer, [first, second])
    streamed = observer.result().boundaries["0->1"]["handoff"]
    assert streamed.tolist() == pytest.approx(handoff_ratio(first, second).tolist(), rel=1e-12)


def test_dynamics_are_read_back_from_the_curves():
    summary = summary_of([loops(0.6)], 30, drift=0.0)
    group = summary["checkpoints"][0]["budgets"]["long"]["groups"][0]
    floor = noise_floor_step(group["step_size"]["mean"])
    dynamics = dynamics_from_curves(group["step_size"]["mean"], group["cosine"]["mean"], floor)
    assert dynamics.contraction == pytest.approx(0.6, rel=1e-6) and dynamics.rotation == pytest.approx(SPIRAL)


def test_a_summary_without_the_handoff_ratio_names_it():
    summary = summary_of([loops(0.6, groups=2)], 12, drift=0.0)
    del summary["checkpoints"][0]["budgets"]["long"]["dlr"]["4->5-6"]["handoff"]
    with pytest.raises(RdepthError, match="lacks 'handoff'.*rerun `rdepth analyze`") as error:
        C.claim_dlr(summary)
    assert "\n" not in str(error.value)
    summary = summary_of([loops(0.6, groups=2)], 12, drift=0.0)
    del summary["checkpoints"][0]["budgets"]["long"][HANDOFF_CONTROL]
    with pytest.raises(RdepthError, match=f"lacks '{HANDOFF_CONTROL}'"):
        C.claim_dlr(summary)
    del summary["checkpoints"][0]["budgets"]["long"]["groups"][0]["headline"]["settled_cosine_window"]["reason"]
    with pytest.raises(RdepthError, match="lacks 'settled_cosine_window.reason'.*group 4"):
        C.claim_cosine(summary)
    del summary["checkpoints"][0]["budgets"]["long"]["groups"][0]["headline"]["settled_cosine_window"]
    with pytest.raises(RdepthError, match="lacks 'settled_cosine_window'.*group 4"):
        C.claim_cosine(summary)
    summary = summary_of([loops(0.6, groups=2)], 12, drift=0.0)  # a format-5 control: no per-token reading
    del summary["checkpoints"][0]["budgets"]["long"][HANDOFF_CONTROL]["4->5-6"]["over_control"]
    with pytest.raises(RdepthError, match=f"lacks '{HANDOFF_CONTROL}.over_control'.*rerun `rdepth analyze`"):
        C.claim_dlr(summary)


def test_the_cli_answers_a_stale_summary_in_one_line_with_exit_2(monkeypatch, capsys):
    summary = summary_of([loops(0.6, groups=2)], 12, drift=0.0)
    del summary["checkpoints"][0]["budgets"]["long"]["dlr"]["4->5-6"]["handoff"]

    def judged(config):
        C.claim_dlr(summary)

    monkeypatch.setattr("rdepth.reproduce.run.run_reproduce", judged)
    assert main(["reproduce", "two-scale", "--minutes", "2", "--device", "cpu"]) == 2
    error = capsys.readouterr().err.strip()
    assert "lacks 'handoff'" in error and "rdepth analyze" in error and len(error.splitlines()) == 1


# ------------------------------------------------------------------ claim 2: settled means settled


def test_collinear_steps_are_not_reproduced():
    claim = C.claim_cosine(summary_of([loops(0.6, rotation=0.0)] * 2, 30, drift=0.0))
    assert claim["verdict"] == C.NOT
    assert all(g["settled_cosine"] == pytest.approx(1.0) and g["status"] == "collinear"
               for g in claim["ours"]["groups"])


def test_a_spiral_in_the_band_is_reproduced():
    claim = C.claim_cosine(summary_of([loops(0.6)] * 2, 30, drift=0.0))
    assert claim["verdict"] == C.REPRODUCED
    assert all(g["settled_cosine"] == pytest.approx(0.58) for g in claim["ours"]["groups"])


def test_a_loop_at_the_floor_soon_after_its_decay_is_not_measured():
    """Steps shrink 5x per step: a tenth of ||Δ(1)|| at k = 3 (the decay), under 1e-3 of it at k = 6 (the floor):
    cosines 3 and 4 are after the decay and above the floor, fewer than the five a settled cosine needs, so
    nothing can be read (before, cos(Δ0, Δ1) and the transient were averaged into a 'settled' cosine)."""
    summary = summary_of([loops(0.2)], 30, drift=0.0)
    group = summary["checkpoints"][0]["budgets"]["long"]["groups"][0]
    assert noise_floor_step(group["step_size"]["mean"]) == 6 and group["headline"]["decayed_step"] == 3
    assert group["headline"]["settled_cosine"] is None
    assert group["headline"]["settled_cosine_window"]["usable"] == 2
    assert group["headline"]["settled_cosine_window"]["reason"] == "too few"
    claim = C.claim_cosine(summary)
    assert claim["verdict"] == C.UNTESTED and "no group has 5 cosines" in claim["why"][0]


def test_the_settled_window_on_known_curves():
    # the step from the random start (cosine 0) is never read; cosine j counts while update j+1 is above the floor
    curve = [-0.9, 0.1, 0.5, 0.55, 0.6, 0.5, 0.55, 0.6, 7.0, 7.0]
    assert settled_window(curve, None) == {"usable": 9, "window": [5, 9], "plateau": False, "range": pytest.approx(6.5),
                                           "slope": pytest.approx(1.945), "reason": "range"}
    assert settled_window(curve, 9) == {"usable": 7, "window": [3, 7], "plateau": True, "range": pytest.approx(0.1),
                                        "slope": pytest.approx(0.005), "reason": None}
    assert settled_window(curve, 6) == {"usable": 4, "window": None, "plateau": False, "range": None, "slope": None,
                                        "reason": "too few"}
    assert settled_window(curve, 9, decayed=4)["reason"] == "too few"  # cosines 4..7 after the decay: four
    assert settled_window(curve, 9, decayed=None)["reason"] == "no decay"
    wandering = [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.7]  # five usable cosines, spread 0.8: not settled
    assert settled_window(wandering, None)["plateau"] is False
    falling = [0.0] + [0.9 - 0.04 * j for j in range(1, 12)]  # within 0.2 over five cosines, never settles
    window = settled_window(falling, None)
    assert window["range"] < 0.2 and window["slope"] == pytest.approx(-0.04) and window["reason"] == "trend"
    # 0.8 - 0.6 = 0.20000000000000007 in floating point: a range of 0.2 is within the bar
    edge = [0.0, 0.6, 0.8, 0.7, 0.8, 0.6]
    assert settled_window(edge, None)["range"] > 0.2 and settled_window(edge, None)["plateau"] is True


# ------------------------------------------------------------------ claim 1: decay, and faster over training


def test_loops_that_barely_contract_are_not_reproduced():
    claim = C.claim_step_decay(summary_of([loops(0.97), loops(0.97)], 30, drift=0.0))
    assert claim["verdict"] == C.NOT
    assert claim["ours"]["trend"]["holds"] is False


def test_fast_decay_getting_faster_is_reproduced():
    claim = C.claim_step_decay(summary_of([loops(0.7), loops(0.5)], 30, drift=0.0))
    assert claim["verdict"] == C.REPRODUCED
    assert claim["ours"]["trend"]["holds"] is True
    assert all(g["last"] == pytest.approx(0.5 ** 9) for g in claim["ours"]["trend"]["groups"])


def test_fast_decay_getting_slower_is_only_partly():
    claim = C.claim_step_decay(summary_of([loops(0.5), loops(0.7)], 30, drift=0.0))
    assert claim["verdict"] == C.PARTLY and claim["ours"]["trend"]["holds"] is False
