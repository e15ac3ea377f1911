"""TrainConfig.fp8 (rdepth.train.fp8): which matmuls go to torchao's float8 training, the adapter halves
through the model's hook exactly as a Float8Linear holding the half, checkpoints identical to a bf16
run's and loadable without torchao, the refusals, the resume rule, and a few training steps.

torch's CPU build runs float8 matmuls (``torch._scaled_mm`` with float8 inputs), so the float8 numerics
themselves are tested here too, through the trainer with its device check lifted (``rdepth train``
refuses --fp8 on a CPU: it would be slower than float32, never faster). The bf16-autocast run on a card
with float8 tensor cores is the ``gpu`` test at the end."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from torch import nn

from rdepth.errors import RdepthError
from rdepth.model import RecurrentLM
from rdepth.model.noise import StateNoise
from rdepth.model.recurrent import adapter_matmul
from rdepth.train.config import TrainConfig
from rdepth.train.fp8 import FP8Plan, check_fp8_device, convert_to_fp8, fp8_plan, require_torchao
from rdepth.train.resume import check_resume_config

pytest.importorskip("torchao", reason="pip install 'rdepth[fp8]'")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LINEARS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")


def fresh_model(**overrides) -> RecurrentLM:
    torch.manual_seed(0)
    return RecurrentLM(tiny_config(**overrides)).train()


def test_the_plan_names_every_layer_and_adapter_matmul_and_nothing_else():
    """The tiny model: 5 layers (layer 0 and 4 single-pass, 1 and 2-3 looped), d = 16, two groups."""
    plan = fp8_plan(fresh_model())
    assert plan.layers == [f"layers.{i}.{name}" for i in range(5) for name in LINEARS]
    assert plan.adapters == ["adapters.0", "adapters.1"]
    assert plan.left_out == {}
    # d = 24: every layer matmul has a dim of 24, and the adapters' halves are 24 x 24: all left out, said why.
    odd = fp8_plan(fresh_model(d_model=24, n_head=2))
    assert odd.layers == [] and odd.adapters == []
    assert odd.left_out["layers.0.mlp.fc"] == "dims 96x24 are not multiples of 16"
    assert odd.left_out["adapters.1"] == "dims 24x24 halves are not multiples of 16"
    assert len(odd.left_out) == 5 * 4 + 2


def test_conversion_swaps_exactly_the_planned_modules_and_keeps_the_parameters():
    model = fresh_model()
    before = {name: param for name, param in model.named_parameters()}
    head = model.wte.weight
    plan = convert_to_fp8(model)
    converted = sorted(name for name, module in model.named_modules() if isinstance(module, Float8Linear))
    assert converted == sorted(plan.layers + plan.adapters)
    assert type(model.wte) is nn.Embedding and model.wte.weight is head  # the tied head stays as it was
    assert model.adapter_matmul is not adapter_matmul
    # The same Parameter objects: an optimizer built before the conversion still steps the model.
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[name] is before[name] for name in before)


def test_a_fresh_model_keeps_the_plain_adapter_matmul():
    model = fresh_model()
    assert model.adapter_matmul is adapter_matmul
    x = torch.randn(3, 16)
    assert torch.equal(model.adapter_matmul(model.adapters[0], x, slice(16, None)),
                       torch.nn.functional.linear(x, model.adapters[0].weight[:, 16:]))


@pytest.mark.parametrize("columns", [slice(None, 16), slice(16, None)])
def test_an_adapter_half_in_float8_equals_a_float8_linear_holding_that_half(columns):
    """The hook multiplies a slice of the adapter's weight: forward and both gradients bit-equal to a
    Float8Linear whose weight is that half (so the adapters get exactly torchao's float8 matmul)."""
    model = fresh_model()
    convert_to_fp8(model)
    adapter = model.adapters[1]
    half = nn.Linear(16, 16, bias=False)
    half.weight.data.copy_(adapter.weight.data[:, columns])
    half = Float8Linear.from_float(half, config=adapter.config)
    x = torch.randn(2, 7, 16, requires_grad=True)
    x_half = x.detach().clone().requires_grad_()
    out, expected = model.adapter_matmul(adapter, x, columns), half(x_half)
    assert torch.equal(out, expected)
    assert not torch.equal(out, torch.nn.functional.linear(x, adapter.weight[:, columns]))  # float8 rounding ran
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert torch.equal(x.grad, x_half.grad)
    assert torch.equal(adapter.weight.grad[:, columns], half.weight.grad)
    other = slice(16, None) if columns.start is None else slice(None, 16)
    assert torch.count_nonzero(adapter.weight.grad[:, other]) == 0


def test_checkpoints_are_the_keys_and_plain_tensors_of_a_bf16_run_and_load_without_torchao(tmp_path):
    from rdepth.run import checkpoint as ckpt

    plain, converted = fresh_model(), fresh_model()
    convert_to_fp8(converted)
    expected, got = plain.state_dict(), converted.state_dict()
    assert list(got) == list(expected)
    for name, tensor in got.items():
        assert type(tensor) is torch.Tensor and tensor.dtype == torch.float32, name
        assert torch.equal(tensor, expected[name]), name
    optimizer = torch.optim.AdamW(converted.parameters())
    converted(torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8)), (2, 2)).loss.backward()
    optimizer.step()
    path = ckpt.save_checkpoint(tmp_path, 1, converted, converted.config, {"optimizer": optimizer.state_dict()},
                                {"tokens_seen": 0})
    # A process in which torchao cannot be imported loads the weights and the optimizer state.
    script = (
        "import sys; sys.modules['torchao'] = None\n"
        "import torch\n"
        "from pathlib import Path\n"
        "from rdepth.model import RecurrentLM\n"
        "from rdepth.run import checkpoint as ckpt\n"
        f"path = Path({str(path)!r})\n"
        "model = RecurrentLM(ckpt.load_model_config(path))\n"
        "ckpt.load_weights(path, model)\n"
        "trainer_state, state = ckpt.load_trainer_state(path)\n"
        "torch.optim.AdamW(model.parameters()).load_state_dict(trainer_state['optimizer'])\n"
        "print(sum(float(p.double().sum()) for p in model.parameters()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    total = sum(float(p.detach().double().sum()) for p in converted.parameters())
    assert float(proc.stdout.strip()) == pytest.approx(total, rel=1e-12)


def test_refusals_are_one_line_errors(monkeypatch):
    with pytest.raises(RdepthError, match=r"compute capability >= 8.9 .* device is cpu: drop --fp8"):
        check_fp8_device(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RdepthError, match="NVIDIA A100-SXM4-80GB is 8.0: drop --fp8"):
        check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(torch.device("cuda", 0))  # an H100
    with pytest.raises(RdepthError, match="fp8 is not supported with --parallel fsdp"):
        TrainConfig(fp8=True, parallel="fsdp")
    with pytest.raises(RdepthError, match="fp8 must be true or false"):
        TrainConfig(fp8="yes")
    for name in ("torchao", "torchao.float8", "torchao.float8.float8_linear"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(RdepthError, match=r"--fp8 needs torchao .*pip install 'rdepth\[fp8\]'"):
        require_torchao()


def test_rdepth_train_fp8_on_a_cpu_stops_before_reading_data(tmp_path, capsys):
    from reliability_helpers import error_line, train_argv

    from rdepth.cli.main import main

    code = main(train_argv(tmp_path / "no-data", tmp_path / "run", "--fp8", "--device", "cpu"))
    assert code == 2
    assert "--fp8 needs a CUDA card of compute capability >= 8.9" in error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_fp8_may_change_on_resume_and_the_change_is_recorded():
    saved = TrainConfig(max_steps=10)
    assert check_resume_config(saved, TrainConfig(max_steps=10, fp8=True), 5) == {"fp8": [False, True]}
    assert check_resume_config(TrainConfig(max_steps=10, fp8=True), TrainConfig(max_steps=20), 5) == \
        {"max_steps": [10, 20], "fp8": [True, False]}
    with pytest.raises(RdepthError, match="lr"):
        check_resume_config(saved, TrainConfig(max_steps=10, fp8=True, lr=1e-3), 5)


def steps_of(fp8: bool, steps: int, monkeypatch) -> tuple[list[float], object]:
    from rdepth.train import step as step_module

    monkeypatch.setattr(step_module, "check_fp8_device", lambda device: None)  # float8 on the CPU, for the test
    config = TrainConfig(data="(random ids)", out="(none)", batch_size=4, device="cpu", compile=False, seed=0,
                         fp8=fp8, max_steps=100, warmup_steps=2, lr=1e-2)
    trainer = step_module.TrainStep.on_tokens(tiny_config(vocab_size=64), config)
    return [float(trainer.train_step(step)[0]) for step in range(steps)], trainer


def test_training_steps_in_float8_follow_the_float32_run(monkeypatch):
    """The same seed, batches, loop counts and noise: the float8 run's loss stays within 2% of the float32
    run's at every step (measured: within 0.5%), and is not the same run (float8 rounding happened)."""
    reference, _ = steps_of(False, 6, monkeypatch)
    losses, trainer = steps_of(True, 6, monkeypatch)
    assert isinstance(trainer.fp8_plan, FP8Plan) and len(trainer.fp8_plan.layers) == 20
    assert isinstance(trainer.model.layers[2].mlp.fc, Float8Linear)
    gaps = [abs(a - b) / b for a, b in zip(losses, reference, strict=False)]
    assert max(gaps) < 0.02, gaps
    assert losses != reference
    # The parameters are still float32 nn.Parameters: the optimizer stepped them.
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in trainer.model.parameters())


def test_one_compiled_loop_step_in_float8_equals_the_uncompiled_one():
    """compile_scope step (fullgraph, no graph break) through the float8 hook: the same loss and gradients
    (dynamo's eager backend: the graph capture is what is tested, not Inductor's kernels)."""
    from rdepth.train.step import compile_loop_steps

    torch._dynamo.reset()
    model = fresh_model()
    convert_to_fp8(model)
    reference = copy.deepcopy(model)
    compile_loop_steps(model, backend="eager")
    idx = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    for counts in ((3, 3), (1, 4)):
        results = []
        for m in (model, reference):
            m.zero_grad()
            loss = m(idx, idx, counts, noise=StateNoise(0, range(2))).loss
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]))
        assert torch.equal(results[0][0], results[1][0])
        assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=False))


def _float8_card() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _float8_card(), reason="needs a CUDA card of compute capability >= 8.9")
def test_float8_on_the_card_follows_bf16():
    """bf16 autocast and float8 tensor cores, compiled layers: 8 steps within 2% of the bf16 run's loss."""
    from rdepth.train.step import TrainStep

    runs = {}
    for fp8 in (False, True):
        config = TrainConfig(data="(random ids)", out="(none)", batch_size=8, device="cuda", compile=True, seed=0,
                             fp8=fp8, max_steps=100, warmup_steps=2, lr=1e-2)
        trainer = TrainStep.on_tokens(tiny_config(vocab_size=64, d_model=64, n_head=4), config)
        runs[fp8] = [float(trainer.train_step(step)[0]) for step in range(8)]
    gaps = [abs(a - b) / b for a, b in zip(runs[True], runs[False], strict=False)]
    assert max(gaps) < 0.02, (runs, gaps)
    assert runs[True] != runs[False]


def test_the_suite_section_trains_both_runs_on_the_same_tokens(monkeypatch, tmp_path, wiki_small):
    """bench/gpu/fp8.py on a CPU with the device check lifted: the tiny preset on a prepared folder's tokens
    (its vocabulary), 3 steps each; the same loop counts in both runs, both curves, the gaps from them.
    (Without the lift the section records 'skipped (needs CUDA sm_89+)': tests/test_gpu_suite.py.)"""
    import time

    from bench.gpu.fp8 import fp8_section
    from bench.gpu.report import evaluate_targets, markdown
    from bench.gpu.suite import parse_args
    from rdepth.train import fp8 as fp8_module
    from rdepth.train import step as step_module

    monkeypatch.setattr(fp8_module, "check_fp8_device", lambda device: None)
    monkeypatch.setattr(step_module, "check_fp8_device", lambda device: None)
    # one sequence a step: float8 matmuls on a CPU run through torchao's reference path (slow: 298 s at 2)
    args = parse_args(["--smoke", "--out", str(tmp_path), "--sections", "fp8", "--device", "cpu",
                       "--fp8-data", str(wiki_small), "--train-set", "fp8=true", "--train-batch", "1"])
    result = fp8_section(args, torch.device("cpu"), time.perf_counter() + 120, {"device_name": "cpu"})
    assert result["status"] == "ok" and result["steps"] == 3 and result["train_set"] == {}
    bf16, fp8 = result["bf16"], result["fp8"]
    assert len(bf16["loss"]) == len(fp8["loss"]) == 3 and bf16["loop_counts"] == fp8["loop_counts"]
    assert bf16["loss"] != fp8["loss"] and fp8["plan"]["adapters"] == ["adapters.0", "adapters.1", "adapters.2"]
    assert result["relative_gap"] == [(b - a) / a for a, b in zip(bf16["loss"], fp8["loss"], strict=False)]
    assert result["max_abs_relative_gap"] < 0.02 and bf16["mfu"] is None and fp8["tokens_per_s"] > 0
    assert "wiki512" in result["data"] and "bpe:512" in result["data"]
    report = {"environment": {"device": "cpu"}, "settings": {"smoke": True, "preset": "tiny", "budget_s": 60.0},
              "sections": {"fp8": result}}
    targets = {t["id"]: t for t in evaluate_targets(report)}
    assert targets["train_fp8_loss"]["met"] is (result["max_abs_relative_gap"] <= 0.01)
    assert targets["train_fp8_mfu"]["met"] is None  # an absolute target: H100/H200 only
    assert "| fp8 | " in markdown({**report, "targets": list(targets.values())})


def test_a_failed_fp8_run_keeps_the_bf16_curve(monkeypatch, tmp_path):
    import time

    from bench.gpu.fp8 import fp8_section
    from bench.gpu.suite import parse_args
    from rdepth.train import fp8 as fp8_module
    from rdepth.train import step as step_module

    def broken(model):
        raise RuntimeError("no float8 kernel")

    monkeypatch.setattr(fp8_module, "check_fp8_device", lambda device: None)
    monkeypatch.setattr(step_module, "check_fp8_device", lambda device: None)
    monkeypatch.setattr(step_module, "convert_to_fp8", broken)
    args = parse_args(["--smoke", "--out", str(tmp_path), "--sections", "fp8", "--device", "cpu", "--fp8-steps", "2"])
    result = fp8_section(args, torch.device("cpu"), time.perf_counter() + 60, {"device_name": "cpu"})
    assert result["status"] == "error" and result["error"] == "fp8 run: RuntimeError: no float8 kernel"
    assert len(result["bf16"]["loss"]) == 2 and result["fp8"]["status"] == "error"
    assert "random token ids" in result["data"]


def test_a_run_resumed_with_fp8_records_it_and_its_checkpoints_keep_the_bf16_keys(wiki_small, tmp_path, monkeypatch):
    """rdepth train for 3 steps, then --resume --max-steps 6 --fp8 (the device check lifted: float8 on the
    CPU): the switch is recorded in config.json, the float8 steps train, and the float8 run's checkpoint
    holds the keys and float32 tensors of the first one."""
    import json

    from reliability_helpers import train_argv
    from safetensors.torch import load_file

    from rdepth.cli.main import main
    from rdepth.run.checkpoint import list_checkpoints
    from rdepth.train import step as step_module

    monkeypatch.setattr(step_module, "check_fp8_device", lambda device: None)
    run = tmp_path / "run"
    assert main(train_argv(wiki_small, run, "--max-steps", "3")) == 0
    assert main(["train", "--out", str(run), "--resume", "--max-steps", "6", "--fp8", "--threads", "1"]) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["resumes"] == [{"step": 3, "changed": {"max_steps": [3, 6], "fp8": [False, True]}}]
    checkpoints = list_checkpoints(run)  # steps 3 (bf16) and 6 (fp8)
    first, last = (load_file(str(path / "model.safetensors")) for path in (checkpoints[0], checkpoints[-1]))
    assert list(first) == list(last) and all(last[k].dtype == torch.float32 for k in last)
    assert any(not torch.equal(first[k], last[k]) for k in first)  # the float8 steps trained
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3, 4, 5, 6]
