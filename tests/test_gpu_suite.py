"""bench/gpu_suite.py (the package bench/gpu/): its CPU-sized smoke run end to end, and its FLOP counter on a
hand-computed case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu.report import kernel_rows
from bench.gpu.suite import parse_args
from bench.gpu.train import peak_tflops, train_flops_per_row

ROOT = Path(__file__).resolve().parents[1]


def test_flops_hand_computed():
    """n_layer 3 (layer 1 looped), d 8, h 32, V 10, T 4, backprop depth 2, 3 loop steps.

    Per layer application and row: matmul weights 4*64 + 2*8*32 = 768, forward 2*768*4 = 6144,
    causal attention 2*8*4*5 = 320: 6464 forward, 12928 backward. Adapter 2*64 = 128 weights:
    2*128*4 = 1024 forward. Head 10*8 = 80 weights: 640 forward, 1280 backward.
    Singles (layers 0, 2): 12928 forward, 25856 backward. Group: 3 steps of 6464 + 1024 = 7488
    forward = 22464; backward on the last 2 only: 2 * 2 * 7488 = 29952.
    Forward 12928 + 22464 + 640 = 36032; backward 25856 + 29952 + 1280 = 57088.
    """
    from rdepth.config import ModelConfig

    config = ModelConfig(n_layer=3, n_head=2, d_model=8, block_size=4, vocab_size=10, groups="1",
                         mean_loops=3.0, backprop_depth=2, mlp_ratio=4)
    flops = train_flops_per_row(config, (3,))
    assert flops == {"forward": 36032, "backward": 57088, "total": 93120, "layer_applications": 5}

    # Every step under gradients: three times the forward (the 6 N T rule, attention included).
    deep = train_flops_per_row(config.replace(backprop_depth=8), (3,))
    assert deep["total"] == 3 * deep["forward"] == 3 * 36032
    # A plain model of the unrolled depth: 5 layers with gradients, no adapters.
    plain = train_flops_per_row(config.replace(groups="", n_layer=5), ())
    assert plain["total"] == 3 * (5 * 6464 + 640) and plain["layer_applications"] == 5


def test_peak_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.4
    assert peak_tflops("cpu (1 threads)") is None


def skipped_at_time_budget(entry: dict) -> bool:
    """A setting the suite skipped because its section's share of ``--budget-s`` was spent (a loaded
    machine): only these two reasons count, any other status fails the caller's checks."""
    return entry.get("status") == "skipped" and entry.get("reason") == "out of time" or \
        str(entry.get("status", "")).startswith("skipped: the section's time is out")


def test_skip_at_the_time_budget_is_recognised_and_nothing_else():
    assert skipped_at_time_budget({"status": "skipped", "reason": "out of time"})
    assert skipped_at_time_budget({"status": "skipped: the section's time is out (a budget-1 decoder would compile)"})
    assert not skipped_at_time_budget({"status": "skipped", "reason": "the model has no recurrence groups"})
    assert not skipped_at_time_budget({"status": "error", "error": "RuntimeError"})
    assert not skipped_at_time_budget({"per_loop_step": 1.0})


def test_smoke_run(tmp_path):
    """Every section runs on the tiny preset on the CPU and leaves numbers (or 'cuda only')."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "bench.gpu_suite", "--smoke", "--out", str(tmp_path), "--device", "cpu"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    markdown = (tmp_path / "gpu_suite.md").read_text()

    env_info = report["environment"]
    for key in ("device", "torch", "revision", "code_sha256", "python"):
        assert env_info.get(key), key
    sections = report["sections"]
    assert list(sections) == ["ceiling", "train", "decode", "exits", "batched", "spread", "loss"]
    assert sections["ceiling"]["status"] == "cuda only"
    for name in ("train", "decode", "exits", "batched"):
        assert sections[name]["status"] == "ok", sections[name].get("traceback", sections[name])

    train = sections["train"]
    for model in ("looped", "plain"):
        entry = train[model]
        assert entry["tokens_per_s"] > 0 and entry["achieved_tflops"] > 0 and entry["steps_timed"] >= 1
        assert entry["mfu"] is None  # no bf16 peak on a CPU
        assert len(entry["loop_counts"]) == entry["steps_timed"] == len(entry["flops_per_step"])
    assert all(len(counts) == 3 for counts in train["looped"]["loop_counts"])  # the tiny preset's 3 groups
    assert train["plain_depth"] == 18 and train["layer_application_throughput_ratio"] > 0

    decode = sections["decode"]
    for key in ("static_eager", "plain_static_eager", "static_inductor", "plain_static_inductor"):
        assert decode[key]["ms_per_token"] > 0, key
    assert decode["static_inductor"]["path"] == "inductor+eager" and decode["static_inductor"]["compile_s"] > 0
    assert decode["static_graph"] == {"status": "cuda only"}
    assert decode["plain_static_graph"] == {"status": "cuda only"}
    assert decode["best_looped_path"] in ("eager", "inductor+eager")
    # Kernel counts: on a CPU the same code counts leaf aten ops per token and per loop step.
    counts = decode["kernel_counts"]
    assert counts["status"] == "ok", counts
    assert counts["what"] == "aten ops (CPU)" and counts["tokens"] == 2
    per_token = counts["per_token"]
    assert set(per_token) == {"static_eager", "static_inductor", "plain_static_eager", "plain_static_inductor"}
    for key, entry in per_token.items():
        assert entry["per_token"] == entry["aten_ops"] > 0 and entry["value_reads"] == 0, key
    assert per_token["static_inductor"]["per_token"] < per_token["static_eager"]["per_token"]  # fused away
    assert per_token["plain_static_eager"]["per_token"] < per_token["static_eager"]["per_token"]
    for key in ("static_eager", "static_inductor"):
        step = counts["per_loop_step"][key]
        if key == "static_inductor" and skipped_at_time_budget(step):
            continue  # a loaded machine: the suite skips the compile at its time budget, and says so
        assert step["extra_loop_steps"] == 3 * 11 and step["budget_1"] < step["full_budget"], key
        assert step["per_loop_step"] == (step["full_budget"] - step["budget_1"]) / 33 > 0
    assert "aten ops (CPU) per loop step, static eager / Inductor pieces |" in markdown

    exits = sections["exits"]
    assert exits["loop_step_ms"] > 0 and exits["loop_step_ms_inductor"] > 0
    assert set(exits["check_cost"]) == {"no_host_check", "check_every_2", "no_host_check_inductor",
                                        "check_every_2_inductor"}
    runs = exits["policy_runs"]
    ran = [run for run in runs.values() if not skipped_at_time_budget(run)]
    assert ran and not skipped_at_time_budget(next(iter(runs.values())))  # the first always runs
    for run in ran:
        assert 1 <= sum(run["mean_steps"]) / len(run["mean_steps"]) <= 12
        assert 0 <= run["agreement"] <= 1 and run["bound_ms"] is not None

    batched = sections["batched"]
    assert set(batched["by_batch"]) == {"2", "4"}
    assert batched["by_batch"]["2"]["status"] == "ok"  # the first batch always runs
    for row in batched["by_batch"].values():
        if skipped_at_time_budget(row):
            continue
        assert row["status"] == "ok"
        for key in ("full", "exits_predicated", "exits", "fixed_same_mean"):
            assert row[key]["tokens_per_s"] > 0
        assert row["exits"]["variant"] == "exits_predicated"
        assert 0 <= row["exits"]["agreement"] <= 1

    spread = sections["spread"]  # exits drawn from the recorded histogram of a trained model
    assert spread["status"] == "ok" and spread["histogram"]["source"]["policy"]
    row = spread["by_batch"]["4"]
    assert row["status"] == "ok" and row["full"]["tokens_per_s"] > 0
    assert row["spread_predicated"]["tokens_per_s"] > 0
    steps = row["spread_predicated"]["mean_steps"]
    assert all(1 <= m < 12 for m in steps)  # the drawn exits, not the full budget
    assert all(e >= m for e, m in zip(row["spread_predicated"]["executed_steps"], steps, strict=False))
    assert "spread_compacted" not in row and "spread_conditional" not in row  # removed paths
    loss = sections["loss"]
    assert loss["status"] == "ok" and abs(loss["fused"]["loss"] - loss["unfused"]["loss"]) < 1e-4
    assert "Batched exits on a trained model's exit spread" in markdown

    ids = [target["id"] for target in report["targets"]]
    assert ids == ["train_mfu", "train_layer_ratio", "decode_looped_ms", "decode_plain_ms", "exit_check_cost",
                   "exit_latency", "batched_exits_32", "batched_vs_fixed", "suite_runtime"]
    for target in report["targets"]:
        assert f"| {target['target']} |" in markdown
    # Smoke runs judge no absolute (H100) target.
    absolute = {t["id"]: t["met"] for t in report["targets"]}
    assert absolute["decode_looped_ms"] is None and absolute["suite_runtime"] is None
    assert "cuda only" in markdown and env_info["revision"] in markdown
    assert "| target | measured | met? |" in proc.stdout  # the table is printed at the end


def test_the_fp8_section_runs_when_named_and_says_why_it_skips_on_a_cpu(tmp_path):
    """``--sections fp8`` (never in the default list): on a CPU it records why it did not train (the section's
    training path on a CPU, the device check lifted: tests/test_fp8.py), and its two targets are listed."""
    assert "fp8" not in parse_args(["--out", str(tmp_path)]).sections
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "bench.gpu_suite", "--smoke", "--out", str(tmp_path), "--device", "cpu",
               "--sections", "fp8"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    fp8 = report["sections"]["fp8"]
    assert fp8["status"] == "skipped (needs CUDA sm_89+)" and "device is cpu" in fp8["reason"]
    targets = {t["id"]: t for t in report["targets"]}
    assert targets["train_fp8_mfu"]["met"] is None and targets["train_fp8_loss"]["met"] is None
    assert "FP8 training: skipped (needs CUDA sm_89+)" in (tmp_path / "gpu_suite.md").read_text()


def test_kernel_rows_show_a_failed_count():
    rows = kernel_rows({"status": "error", "error": "RuntimeError: no CUPTI"})
    assert rows == ["| kernels per token | error: RuntimeError: no CUPTI | |"]
    failed = {"status": "error", "error": "x"}
    rows = kernel_rows({"status": "ok", "what": "CUDA kernels", "per_token": {
        "static_eager": {"per_token": 412.0}, "static_inductor": failed, "plain_static_eager": {"per_token": 90.5},
        "plain_static_inductor": {"status": "no decoder (row failed)"},
        "static_graph_replay": {"per_token": 412.0, "kernel_launches": 1.0}},
        "per_loop_step": {"static_eager": {"per_loop_step": 20.25}, "static_inductor": {"status": "skipped"}}})
    assert rows == ["| CUDA kernels per token, static eager (a CUDA graph holds the same) | 412 | 90.5 |",
                    "| CUDA kernels per token, static, Inductor pieces | error | no decoder (row failed) |",
                    "| CUDA kernels per token, static CUDA graph replayed (launch calls) | 412 (1) | - |",
                    "| CUDA kernels per loop step, static eager / Inductor pieces | 20.2 / skipped | - |"]


@pytest.mark.parametrize("argv", [["--sections", "train,nope"], ["--exit-fraction", "1.5"], ["--batches", "x"],
                                  ["--policy", "nope"], ["--policy", "fixed"], ["--train-batch", "0"],
                                  ["--train-set", "nope=1"], ["--train-set", "compile"], ["--train-set", "seed=x"],
                                  ["--train-set", "warm_start=maybe"], ["--train-set", "compile=true"],
                                  ["--train-set", "seed=3"], ["--fp8-steps", "0"], ["--sections", "fp8,nope"]])
def test_bad_flags_fail_at_parse_time(argv, tmp_path):
    with pytest.raises(SystemExit):
        parse_args(["--out", str(tmp_path), *argv])


def test_train_set_converts_by_the_field_type(tmp_path):
    args = parse_args(["--out", str(tmp_path), "--train-set", "warm_start=on", "--train-set", "grad-clip=0.5",
                       "--train-set", "eval_every=7"])
    assert args.train_set == {"warm_start": True, "grad_clip": 0.5, "eval_every": 7}
    assert parse_args(["--out", str(tmp_path)]).train_set == {}


def test_the_file_entry_runs_from_any_folder(tmp_path):
    """``python3 bench/gpu_suite.py`` (the older command) still runs, from a folder that is not the
    repository root: it hands over to ``python3 -m bench.gpu_suite``."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: python3 -m bench.gpu_suite") and "--sections" in proc.stdout


def test_the_device_call_checks_its_steps_and_keeps_to_its_budget(tmp_path):
    """bench/gpu/device_call.sh refuses an unknown step before running any, and skips a step the call's
    budget no longer covers (nothing runs: these checks need no GPU)."""
    script = ROOT / "bench" / "gpu" / "device_call.sh"
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(script), "rev", "tests", "nope"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "unknown step nope" in proc.stdout and "== tests" not in proc.stdout
    proc = subprocess.run(["bash", str(script), "rev", "train", "tests"], cwd=ROOT,
                          env={**env, "CALL_BUDGET_S": "20"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "== train skipped: 20s of the call's budget left" in proc.stdout
    assert "== tests skipped" in proc.stdout and not list(tmp_path.iterdir())
    # what the steps left in $OUT goes back as one archive (the device tool returns at most 8 files)
    for name in ("a.log", "b.json"):
        (tmp_path / name).write_text(name)
    proc = subprocess.run(["bash", str(script), "rev", "train"], cwd=ROOT, env={**env, "CALL_BUDGET_S": "20"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and [p.name for p in tmp_path.iterdir()] == ["device_call.tgz"]
    import tarfile

    with tarfile.open(tmp_path / "device_call.tgz") as archive:
        assert sorted(n.lstrip("./") for n in archive.getnames() if n not in (".", "./")) == ["a.log", "b.json"]
