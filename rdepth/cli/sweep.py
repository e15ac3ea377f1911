"""``rdepth sweep``: exit policies over a threshold grid; latency, perplexity, loop steps."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build, overrides


def register(subparsers) -> None:
    from rdepth.sweep.config import SweepConfig

    parser = subparsers.add_parser(
        "sweep",
        help="latency / quality of every exit policy over a threshold grid (paper Fig. 4)",
        description="Evaluate held-out text with per-token early exits for each policy over a tau grid "
        "(default 1e-5..1e-2, log scale); record loop steps per group, exit-step histograms, teacher-forced "
        "ms/token (batch 1 and batched; with --generate-tokens also decode latency), perplexity and "
        "cross-entropy, with the fixed budget at the same mean steps as a baseline. Every latency is timed "
        "in interleaved rounds (median and IQR); policies and fixed budgets on the same packed path, fixed "
        "budgets also on the dense path; speedups within noise are flagged. Writes sweep.json (with its "
        "summary), sweep.csv, figures/ and an index.html section into --out. On task data (rdepth prepare "
        "--corpus task:NAME): exact-match accuracy and loop steps on answer tokens and on the rest, per "
        "policy setting and fixed budget 1..k_max on the same packed path, into task_sweep.json. --checkpoint may "
        "instead name a Hugging Face folder of HRM-Text (model_type hrm_text): each training-free rule on its L loop, "
        "its H loop and both, teacher-forced on a UTF-8 text file read with the folder's tokenizer, against the full "
        "budget and every fixed (H, L) budget, cost in stack calls, into looped_sweep.json.",
    )
    add_dataclass_flags(parser, SweepConfig, title="sweep")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.looped.load import looped_source
    from rdepth.sweep.config import SweepConfig
    from rdepth.sweep.run import sweep_checkpoint
    from rdepth.sweep.stats import format_ratio
    from rdepth.sweep.summary import setting_value
    from rdepth.tasks.eval_checkpoint import is_task_data

    config = build(SweepConfig, {}, args)
    given = overrides(args, SweepConfig, check=False)
    if looped_source([config.checkpoint], "sweep"):
        from rdepth.looped.sweep import summary_lines, sweep_folder

        result = sweep_folder(config, given)
        print("\n".join(summary_lines(result)))
        print(f"wrote {result['paths']['json']} and the report {result['paths']['report']}")
        return 0
    config.check_flags_apply(given)  # given, even at its default
    if is_task_data(config.data):
        from rdepth.sweep.task import format_task_sweep, sweep_task_checkpoint

        result = sweep_task_checkpoint(config)
        for line in format_task_sweep(result):
            print(line)
        print(f"wrote {result['paths']['json']} and the report {result['paths'].get('report', '')}")
        return 0
    result = sweep_checkpoint(config)
    summary = result["summary"]
    ranking = summary["headline_ranking"]
    tolerance = f"{100 * summary['tolerance']:g}%"
    print(f"full budget {result['reference']['budget']}: ppl {summary['full_ppl']:.4f}; decoded rules read with "
          f"decode={summary['decode']['mode']} ({summary['decode']['description']})")
    if ranking != "steps":
        print(f"latency: teacher-forced ms/token at batch 1 (one window per forward, time / tokens; not decode "
              f"latency), policies and fixed budgets on the same {summary['timing_path']} path, median of "
              f"{result['config']['repeats']} interleaved rounds; [range] from the IQRs")
    print(f"each policy's {'fewest-steps' if ranking == 'steps' else 'fastest (batch 1)'} point within {tolerance}:")
    for row in summary["matched_quality"][ranking]:
        if row["value"] is None:
            print(f"{row['policy']:>20}: no point within {tolerance} of the full budget's perplexity")
            continue
        speed = f"speedup_vs_full_{ranking}"
        timing = ""
        if speed in row:
            ratio = {"ratio": row[speed], "range": row[f"{speed}_range"], "noise": row[f"{speed}_noise"]}
            timing = f", {format_ratio(ratio)} the full budget's speed"
        print(f"{row['policy']:>20}: value {setting_value(row)}, ppl {row['ppl']:.4f} "
              f"({_percent(row['ppl_vs_full'])}), steps saved {100 * row['steps_saved']:.1f}%{timing}")
    full = next((r for r in summary["packed_over_dense"] if r["budget"] == result["reference"]["budget"]), None)
    if full and "b1" in full:
        print(f"packed / dense path, identical work (full budget, batch 1): {format_ratio(full['b1'])}")
    for warning in summary["noise_warnings"]:
        print(f"WARNING (timing noise): {warning}")
    print(f"wrote {result['paths']['json']} and the report {result['paths'].get('report', '')}")
    return 0


def _percent(fraction: float) -> str:
    """+0.12% / -0.34%, and 0.00% rather than -0.00%."""
    text = f"{100 * fraction:+.2f}%"
    return "0.00%" if text in ("+0.00%", "-0.00%") else text
