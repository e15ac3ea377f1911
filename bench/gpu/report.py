"""The suite's report: issue 12's targets, each met, missed or not judged with its gap, and the
markdown page (targets table, then one table per section) written beside the JSON."""

from __future__ import annotations

from pathlib import Path

from bench.gpu.common import CUDA_ONLY, finite, ratio

TARGET_DEVICES = ("H100", "H200")  # the absolute targets (ms/token, MFU) are set for these cards


def _target(key, text, measured, unit, met, gap, note="") -> dict:
    return {"id": key, "target": text, "measured": finite(measured), "unit": unit, "met": met,
            "gap": finite(gap), "note": note}


class _Judge:
    """What every target's verdict reads: the report's sections, and whether an absolute target (set for
    an H100/H200) can be judged here (not on another card, not in a smoke run)."""

    def __init__(self, report: dict):
        self.sections = report["sections"]
        device = report["environment"].get("device", "")
        on_target_card = any(name in device for name in TARGET_DEVICES)
        smoke = report["settings"]["smoke"]
        self.absolute_judged = on_target_card and not smoke
        self.absolute_note = "" if on_target_card else "absolute target set for an H100/H200; not judged on this device"
        if smoke:
            self.absolute_note = "smoke run (tiny preset); not judged"

    def ok(self, section: str) -> dict:
        """The section when it ran to the end, else an empty dict."""
        return self.sections.get(section, {}) if self.sections.get(section, {}).get("status") == "ok" else {}


def _at_least(value, bound, judged=True):
    """(met, gap) of ``value >= bound``; met is None when nothing was measured or it is not ``judged``."""
    if value is None or not judged:
        return None, None if value is None else value - bound
    return value >= bound, value - bound


def _at_most(value, bound, judged=True):
    """(met, gap) of ``value <= bound``; met is None when nothing was measured or it is not ``judged``."""
    if value is None or not judged:
        return None, None if value is None else bound - value
    return value <= bound, bound - value


def _percent(fraction):
    return None if fraction is None else 100 * fraction


def _train_targets(judge: _Judge) -> list[dict]:
    section = judge.sections.get("train", {})
    train = section if section.get("status") in ("ok", "partial") else {}
    mfu = _percent(train.get("looped", {}).get("mfu"))
    met, gap = _at_least(mfu, 50.0, judge.absolute_judged)
    ceiling = train.get("looped", {}).get("mfu_vs_measured_ceiling")
    note = judge.absolute_note or (f"{100 * ceiling:.1f}% of the measured matmul ceiling" if ceiling else "")
    if train and mfu is None:
        note = "no bf16 peak for this device" if train.get("peak_tflops") is None else "looped model not measured"
    targets = [_target("train_mfu", "paper training (truncated backprop 8): MFU >= 50%", mfu, "% of bf16 peak",
                       met, gap, note)]
    layer_ratio = train.get("layer_application_throughput_ratio")
    met, gap = _at_least(layer_ratio, 0.95)
    flops = train.get("flop_throughput_ratio")
    targets.append(_target("train_layer_ratio", "per-layer-application throughput >= 0.95x a plain GPT "
                           "(same width, mean unrolled depth)", layer_ratio, "x plain", met, gap,
                           f"FLOP/s ratio {flops:.3f}" if flops else ""))
    return targets


def _decode_targets(judge: _Judge) -> list[dict]:
    decode = judge.ok("decode")
    targets = []
    for key, text, name, bound in (
            ("decode_looped_ms", "paper decode, batch 1, 12 loops/group: <= 2.5 ms/token", "looped", 2.5),
            ("decode_plain_ms", "plain 12-layer decode, batch 1: <= 0.8 ms/token", "plain", 0.8)):
        value = decode.get(f"best_{name}_ms")
        met, gap = _at_most(value, bound, judge.absolute_judged)
        path = decode.get(f"best_{name}_path", "")
        targets.append(_target(key, text, value, "ms/token", met, gap,
                               "; ".join(part for part in (path and f"static path, {path}", judge.absolute_note)
                                         if part)))
    return targets


def _check_cost_target(exits: dict, every, suffix: str) -> dict:
    """The per-step exit check's share of a loop step with a host check ``every`` steps, on the path of
    ``suffix`` (the faster one)."""
    chosen = f"check_every_{every}" if every else None
    checks = exits.get("check_cost", {})
    share = _percent(checks.get(chosen + suffix, {}).get("share_of_loop_step") if chosen else None)
    met, gap = _at_most(share, 3.0)
    bare = checks.get("no_host_check" + suffix, {}).get("share_of_loop_step")
    other = checks.get(chosen + ("" if suffix else "_inductor"), {}).get("share_of_loop_step") if chosen else None
    note = ""
    if chosen and bare is not None:
        note = (f"{'Inductor-compiled' if suffix else 'eager'} pieces, with a host check every "
                f"{every} steps; the rule alone, no host check: {100 * bare:.1f}%")
        if other is not None:
            note += f"; {'eager' if suffix else 'Inductor-compiled'} pieces: {100 * other:.1f}%"
    return _target("exit_check_cost", "per-step exit check < 3% of a loop step (batch 1)", share,
                   "% of a loop step", met, gap, note)


def _latency_target(exits: dict, every) -> dict:
    """The policy at about half the steps (a host check ``every`` steps) against the full budget's
    batch-1 latency."""
    run = exits.get("policy_runs", {}).get(f"check_every_{every}", {}) if every else {}
    full_ms = exits.get("full", {}).get("ms_per_token")
    bound = run.get("bound_ms")
    met, gap = _at_most(run.get("ms_per_token"), bound) if bound is not None else (None, None)
    note = (f"steps {run['steps_ratio']:.2f} of the budget; bound {bound / full_ms:.3f}x of the full budget"
            if run and full_ms else "")
    if exits and not exits["calibration"]["on_target"]:
        note += "; calibration missed the target steps"
    return _target(
        "exit_latency", "policy at ~half the steps: batch-1 latency falls >= in proportion to steps saved, less 3%",
        ratio(run.get("ms_per_token"), full_ms), "x full-budget latency", met,
        None if gap is None or not full_ms else gap / full_ms,
        note + _conditional_note(exits.get("policy_conditional", {}), full_ms))


def _exit_targets(judge: _Judge) -> list[dict]:
    exits = judge.ok("exits")
    # Judged on the path that decodes the full budget faster (Inductor-compiled pieces or not).
    compiled_full = exits.get("full_inductor", {}).get("ms_per_token")
    suffix = "_inductor" if compiled_full is not None and compiled_full < exits["full"]["ms_per_token"] else ""
    every = exits.get("best_check_every")
    return [_check_cost_target(exits, every, suffix), _latency_target(exits, every)]


def _batched_targets(judge: _Judge) -> list[dict]:
    by_batch = judge.ok("batched").get("by_batch", {})
    row = by_batch.get("32", {})
    speedup = row.get("exits_over_full")
    met, gap = _at_least(speedup, 1.4)
    targets = [_target("batched_exits_32", "batch 32 with exits: >= 1.4x the full budget's tokens/s "
                       "(matched quality)", speedup, "x full budget", met, gap,
                       (f"{row['exits']['variant'].split('_')[1]} exits; agreement with the full budget "
                        f"{row['exits']['agreement']:.2f}; quality not measurable on random weights"
                        if row.get("exits") else "batch 32 not measured"))]
    measured = {key: r["exits_over_fixed"] for key, r in by_batch.items() if r.get("exits_over_fixed") is not None}
    worst = min(measured.values(), default=None)
    met, gap = _at_least(worst, 1.0)
    targets.append(_target("batched_vs_fixed", "exits never slower than a fixed budget of the same mean steps "
                           "(every batch measured)", worst, "x fixed (worst batch)", met, gap,
                           "batches " + ", ".join(measured)))
    return targets


def _fp8_targets(judge: _Judge) -> list[dict]:
    """Issue 28's float8 targets, where the section was run (--sections fp8)."""
    if "fp8" not in judge.sections:
        return []
    fp8, status = judge.ok("fp8"), judge.sections["fp8"].get("status", "")
    mfu = _percent(fp8.get("fp8", {}).get("mfu"))
    met, gap = _at_least(mfu, 50.0, judge.absolute_judged)
    bf16_mfu = fp8.get("bf16", {}).get("mfu")
    targets = [_target("train_fp8_mfu", "paper training with fp8: MFU >= 50% of the bf16 peak", mfu,
                       "% of bf16 peak", met, gap,
                       judge.absolute_note or (f"bf16 in the same section: {100 * bf16_mfu:.1f}%; fp8/bf16 tokens/s "
                                               f"{fp8['fp8_over_bf16_tokens_per_s']:.3f}" if bf16_mfu else status))]
    worst = _percent(fp8.get("max_abs_relative_gap"))
    met, gap = _at_most(worst, 100 * fp8.get("loss_tolerance", 0.01))
    targets.append(_target("train_fp8_loss", "fp8 loss within 1% of bf16's at every step (same tokens and init)",
                           worst, "% worst step", met, gap,
                           f"{fp8['steps']} steps; final gap {100 * fp8['final_relative_gap']:+.2f}%; {fp8['data']}"
                           if fp8 else status))
    return targets


def evaluate_targets(report: dict) -> list[dict]:
    """Issue 12's targets, each met (True/False) or not judged (None, with the reason) and its gap
    (positive: room to spare; negative: missed by this much, in the target's unit)."""
    judge = _Judge(report)
    elapsed = report.get("elapsed_s")
    met, gap = _at_most(elapsed, 360.0, judge.absolute_judged)
    runtime = _target("suite_runtime", "the whole suite in under 6 minutes on one GPU", elapsed, "s", met, gap,
                      judge.absolute_note)
    return (_train_targets(judge) + _decode_targets(judge) + _exit_targets(judge) + _batched_targets(judge)
            + [runtime] + _fp8_targets(judge))


def _fmt(value, unit="") -> str:
    if value is None:
        return "-"
    text = (f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}") if isinstance(value, float) else str(value)
    return f"{text} {unit}".strip()


def _cell(entry: dict, key="ms_per_token") -> str:
    if entry.get("status") == CUDA_ONLY:
        return CUDA_ONLY
    value = entry.get(key)
    if value is None:
        return entry.get("status", "-")
    iqr = entry.get("iqr")
    return f"{value:.3f} [{iqr[0]:.3f}-{iqr[1]:.3f}]" if iqr and key == "ms_per_token" else f"{value:.4g}"


def kernel_rows(counts: dict) -> list[str]:
    """The decode table's rows of kernels per token and per loop step (:func:`kernel_counts`)."""
    if counts.get("status") != "ok":
        return [f"| kernels per token | {counts.get('status', '-')}: {counts.get('error', '')[:100]} | |"]
    what, per_token, per_step = counts["what"], counts["per_token"], counts["per_loop_step"]

    def cell(entry: dict, key: str) -> str:
        value = entry.get(key)
        return _fmt(value) if value is not None else entry.get("status", "-")

    rows = [f"| {what} per token, static eager (a CUDA graph holds the same) | "
            f"{cell(per_token['static_eager'], 'per_token')} | {cell(per_token['plain_static_eager'], 'per_token')} |",
            f"| {what} per token, static, Inductor pieces | {cell(per_token['static_inductor'], 'per_token')} | "
            f"{cell(per_token['plain_static_inductor'], 'per_token')} |"]
    if "static_graph_replay" in per_token:
        rows.append(f"| {what} per token, static CUDA graph replayed (launch calls) | "
                    f"{cell(per_token['static_graph_replay'], 'per_token')} "
                    f"({cell(per_token['static_graph_replay'], 'kernel_launches')}) | - |")
    rows.append(f"| {what} per loop step, static eager / Inductor pieces | "
                f"{cell(per_step['static_eager'], 'per_loop_step')} / "
                f"{cell(per_step['static_inductor'], 'per_loop_step')} | - |")
    return rows


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# rdepth GPU suite (issue 12)", "",
        f"device **{env.get('device')}**, torch {env.get('torch')}, CUDA {env.get('cuda')}, python "
        f"{env.get('python')}; revision `{env.get('revision')}`"
        f"{' (uncommitted changes)' if env.get('uncommitted_changes') else ''}, code sha256 "
        f"`{env.get('code_sha256')}`; {env.get('date_utc')}; preset `{report['settings']['preset']}`"
        f"{' (smoke)' if report['settings']['smoke'] else ''}; {report.get('elapsed_s', 0):.0f} s of a "
        f"{report['settings']['budget_s']:.0f} s budget", "",
        "| target | measured | met? | gap | note |", "| --- | --- | --- | --- | --- |",
    ]
    for target in report.get("targets", []):
        met = {True: "yes", False: "**no**", None: "-"}[target["met"]]
        lines.append(f"| {target['target']} | {_fmt(target['measured'], target['unit'])} | {met} | "
                     f"{_fmt(target['gap'])} | {target['note']} |")
    lines += ["", "| section | status | seconds |", "| --- | --- | --- |"]
    for name, section in report["sections"].items():
        status = section.get("status", "?")
        if section.get("error"):
            status += ": " + section["error"].splitlines()[0][:120]
        lines.append(f"| {name} | {status} | {_fmt(section.get('section_s'))} |")
    sections = report["sections"]
    decode = sections.get("decode", {})
    if decode.get("status") == "ok":
        lines += ["", "Decode, batch 1, ms/token (median [IQR])", "", "| setting | looped | plain |",
                  "| --- | --- | --- |",
                  f"| static eager | {_cell(decode['static_eager'])} | {_cell(decode['plain_static_eager'])} |",
                  f"| static CUDA graph | {_cell(decode['static_graph'])} | {_cell(decode['plain_static_graph'])} |",
                  f"| static, Inductor pieces, CUDA graph (eager on a CPU) | {_cell(decode.get('static_inductor', {}))} "
                  f"| {_cell(decode.get('plain_static_inductor', {}))} |",
                  *kernel_rows(decode.get("kernel_counts", {})),
                  "", decode.get("fast_path", "")]
    exits = sections.get("exits", {})
    if exits.get("status") == "ok":
        lines += ["", "Exit check (a rule that never fires), batch 1: extra ms per loop step and share of a loop step",
                  "", "| pieces | loop step ms | host check | extra ms/step | share |", "| --- | --- | --- | --- | --- |"]
        for suffix, pieces, step_key in (("", "eager", "loop_step_ms"),
                                         ("_inductor", "Inductor-compiled", "loop_step_ms_inductor")):
            for key, entry in exits["check_cost"].items():
                if key.endswith("_inductor") != bool(suffix):
                    continue
                check = key.removesuffix("_inductor").replace("check_every_", "every ").replace("no_host_check", "none")
                share = entry.get("share_of_loop_step")
                lines.append(f"| {pieces} | {_fmt(exits.get(step_key))} | {check} | {_fmt(entry.get('check_ms_per_step'))} "
                             f"| {'-' if share is None else f'{100 * share:.1f}%'} |")
    train = sections.get("train", {})
    if train.get("status") in ("ok", "partial"):
        lines += ["", "Training step (the trainer's train_step)", "",
                  "| model | batch | tokens/s | TFLOP/s | MFU | layer applications/s | step ms |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for name in ("looped", "plain"):
            entry = train[name]
            if "achieved_tflops" not in entry:
                lines.append(f"| {name} | {entry.get('status')}: {entry.get('error', '')[:100]} | | | | | |")
                continue
            mfu = "-" if entry.get("mfu") is None else f"{100 * entry['mfu']:.1f}%"
            lines.append(f"| {name} | {entry['batch']} | {entry['tokens_per_s']:,.0f} | "
                         f"{entry['achieved_tflops']:.3g} | {mfu} | {entry['layer_applications_per_s']:.4g} | "
                         f"{entry['step_ms']['median']:.1f} |")
    batched = sections.get("batched", {})
    if batched.get("status") == "ok":
        lines += ["", "Batched decode with exits, tokens/s", "",
                  "| batch | full budget | exits, predicated | exits, compacted | fixed, same mean steps | "
                  "exits/full | exits/fixed | agreement |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]

        def rate(entry):
            return "-" if entry is None else f"{entry['tokens_per_s']:,.0f}"

        for batch, row in batched["by_batch"].items():
            if row.get("status") != "ok":
                lines.append(f"| {batch} | {row.get('status')} | | | | | | |")
                continue
            lines.append(f"| {batch} | {rate(row['full'])} | {rate(row['exits_predicated'])} | "
                         f"{rate(row.get('exits_compacted'))} | {rate(row['fixed_same_mean'])} | "
                         f"{row['exits_over_full']:.3f} | {row['exits_over_fixed']:.3f} | "
                         f"{row['exits']['agreement']:.2f} |")
        lines += ["", "exits/full and exits/fixed use the faster exit path of the row."]
        lines += ["", batched.get("quality_note", "")]
    lines += _spread_lines(sections.get("spread", {})) + _loss_lines(sections.get("loss", {}))
    lines += _fp8_lines(sections.get("fp8", {}))
    return "\n".join(lines) + "\n"


def _conditional_note(run: dict, full_ms) -> str:
    """The exit-latency target's note on the same rule run with conditional steps (no host check)."""
    if "ms_per_token" not in run or not full_ms:
        return ""
    return (f"; with conditional steps (no host check): {run['ms_per_token'] / full_ms:.3f}x of the full budget "
            f"(bound {run['bound_ms'] / full_ms:.3f}x)")


def _spread_lines(spread: dict) -> list[str]:
    """The spread section's table: tokens/s, ratio to the full budget and to the fixed budget of the
    same mean steps (of the same executed steps for a conditional row, marked *), mean and executed steps,
    kernels per token."""
    if spread.get("status") != "ok":
        return [] if not spread else ["", f"Exit spread: {spread.get('status')} {spread.get('error', '')}"]
    lines = ["", f"Batched exits on a trained model's exit spread ({spread['histogram']['path']}, "
                 f"check every {spread['check_every']}), tokens/s", "",
             "| batch | setting | tokens/s | x full | x fixed, same mean (*executed) | fixed budget | mean steps | "
             "executed steps | kernels per token |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for batch, row in spread.get("by_batch", {}).items():
        if row.get("status") != "ok":
            lines.append(f"| {batch} | {row.get('status')} | | | | | | | |")
            continue
        lines.append(f"| {batch} | full budget | {row['full']['tokens_per_s']:,.0f} | 1 | | | | | |")
        for name, entry in row.items():
            if name == "full" or name.startswith("fixed_") or not isinstance(entry, dict) or "tokens_per_s" not in entry:
                continue
            fixed = row.get(f"fixed_{name}", {})
            kernels = entry.get("kernels_per_token", {}).get("per_token")
            star = "*" if fixed.get("matched_to") == "executed_steps" else ""
            lines.append(f"| {batch} | {name} | {entry['tokens_per_s']:,.0f} | {_fmt(row.get(name + '_over_full'))} | "
                         f"{_fmt(row.get(name + '_over_fixed'))}{star} | {fixed.get('loop_counts', '-')} | "
                         f"{'/'.join(f'{m:.2f}' for m in entry['mean_steps'])} | "
                         f"{'/'.join(f'{m:.2f}' for m in entry['executed_steps'])} | {_fmt(kernels)} |")
    return lines


def _loss_lines(loss: dict) -> list[str]:
    if loss.get("status") != "ok":
        return [] if not loss else ["", f"Loss head: {loss.get('status')} {loss.get('error', '')}"]
    lines = ["", f"Training loss head, forward + backward, {loss['rows']} rows x {loss['vocab']} ({loss['dtype']})", "",
             "| path | ms | peak MiB over inputs | loss |", "| --- | --- | --- | --- |"]
    for name in ("unfused", "fused", "fused_compiled"):
        entry = loss.get(name)
        if entry is None:
            continue
        lines.append(f"| {name} | {entry['ms']:.2f} | {_fmt(entry.get('peak_mib_over_inputs'))} | {entry['loss']:.4f} |")
    return lines


def _fp8_lines(fp8: dict) -> list[str]:
    """The fp8 section: each run's speed and MFU (against the bf16 peak), then the loss curves side by side."""
    if fp8.get("status") != "ok":
        return [] if not fp8 else ["", f"FP8 training: {fp8.get('status')} {fp8.get('reason', fp8.get('error', ''))}"]
    lines = ["", f"FP8 training against bf16, same tokens and init ({fp8['data']})", "",
             "| run | tokens/s | TFLOP/s | MFU (bf16 peak) | step ms | steps timed |", "| --- | --- | --- | --- | --- | --- |"]
    for name in ("bf16", "fp8"):
        entry = fp8[name]
        mfu = "-" if entry.get("mfu") is None else f"{100 * entry['mfu']:.1f}%"
        lines.append(f"| {name} | {entry['tokens_per_s']:,.0f} | {entry['achieved_tflops']:.3g} | {mfu} | "
                     f"{entry['step_ms']['median']:.1f} | {entry['steps_timed']} |")
    lines += ["", "| step | bf16 loss | fp8 loss | gap |", "| --- | --- | --- | --- |"]
    count = fp8["steps"]
    shown = sorted({0, *range(count - 1, -1, -max(1, count // 10))})
    for step in shown:
        lines.append(f"| {step + 1} | {fp8['bf16']['loss'][step]:.4f} | {fp8['fp8']['loss'][step]:.4f} | "
                     f"{100 * fp8['relative_gap'][step]:+.2f}% |")
    return lines


def write_report(report: dict, out: Path) -> None:
    from rdepth.io import write_json, write_text

    report["targets"] = evaluate_targets(report)
    write_json(out / "gpu_suite.json", report)
    write_text(out / "gpu_suite.md", markdown(report))

