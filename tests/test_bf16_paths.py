"""Low precision: the loss without a full fp32 logits copy, and every exit policy under bf16 autocast
(packed teacher-forced path, cached generation, the sweep), against fp32 on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from rdepth.config import get_preset
from rdepth.exits.controller import controller_factory
from rdepth.exits.gate import random_gate
from rdepth.exits.policies import random_ouro_gate
from rdepth.exits.registry import POLICIES, get_policy_class, sweepable_policies
from rdepth.model import RecurrentLM
from rdepth.model.generation import generate
from rdepth.model.noise import StateNoise
from rdepth.model.recurrent import lm_loss
from rdepth.sweep.config import SweepConfig
from rdepth.sweep.run import run_sweep

K_MAX = (4, 4)


@pytest.fixture(scope="module")
def model() -> RecurrentLM:
    """Two groups with single layers between; the tied embedding scaled up so that logits have
    clear winners (a constructed case where bf16 and fp32 must pick the same tokens)."""
    torch.manual_seed(0)
    config = get_preset("tiny", n_layer=4, n_head=2, d_model=32, block_size=24, vocab_size=64, groups="1|2",
                        mean_loops=2)
    model = RecurrentLM(config).eval()
    with torch.no_grad():
        model.wte.weight.mul_(8)
    return model


def _autocast(dtype):
    return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)


@pytest.fixture(autouse=True)
def strict_index_copy(monkeypatch):
    """``index_copy`` as strict as under CUDA autocast. CPU autocast promotes a bf16 source written
    into an fp32 tensor; CUDA autocast does not, and crashes (the issue's "fp32 buffer written with
    bf16 values in ``_forward_packed``"). Here the CPU refuses it too, so these tests catch it."""
    original = torch.Tensor.index_copy

    def index_copy(self, dim, index, source):
        if self.dtype != source.dtype:
            raise RuntimeError(f"index_copy(): self and source expected to have the same dtype, but got "
                               f"(self) {self.dtype} and (source) {source.dtype}")
        return original(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy", index_copy)


# ------------------------------------------------------------------ the loss

def test_fp32_and_fp64_losses_are_the_cross_entropy_of_today_bit_for_bit(model):
    torch.manual_seed(1)
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    targets[0, :5] = -1
    out = model(idx, targets, loop_counts=(2, 2))
    reference = F.cross_entropy(out.logits.float().reshape(-1, 64), targets.reshape(-1), ignore_index=-1)
    assert torch.equal(out.loss, reference)
    wide = torch.randn(3, 5, 64, dtype=torch.float64)
    assert torch.equal(lm_loss(wide, targets[:, :5].repeat(2, 1)[:3]),
                       F.cross_entropy(wide.float().reshape(-1, 64), targets[:, :5].repeat(2, 1)[:3].reshape(-1),
                                       ignore_index=-1))


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 1000])  # one row, ragged, several, one chunk
def test_bf16_chunked_loss_and_gradient_match_fp32(chunk_rows):
    torch.manual_seed(2)
    logits = (3 * torch.randn(3, 7, 50)).bfloat16()
    targets = torch.randint(0, 50, (3, 7))
    targets[1, 2:] = -1
    low = logits.clone().requires_grad_()
    loss = lm_loss(low, targets, chunk_rows=chunk_rows)
    loss.backward()
    wide = logits.float().requires_grad_()  # the same bf16 values, computed in fp32 the old way
    reference = F.cross_entropy(wide.reshape(-1, 50), targets.reshape(-1), ignore_index=-1)
    reference.backward()
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert low.grad.dtype == torch.bfloat16
    torch.testing.assert_close(low.grad.float(), wide.grad, atol=2e-3 * wide.grad.abs().max().item(), rtol=1e-2)
    assert torch.all(low.grad[1, 2:] == 0)  # ignored rows get no gradient
    assert torch.isnan(lm_loss(logits, torch.full_like(targets, -1)))  # as F.cross_entropy


def _saved_fp32_elements(fn) -> int:
    """The largest fp32 tensor autograd saves for backward while ``fn`` runs."""
    largest = 0

    def pack(tensor):
        nonlocal largest
        if tensor.dtype == torch.float32:
            largest = max(largest, tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return largest


def test_bf16_training_loss_keeps_no_fp32_copy_of_the_logits(model):
    torch.manual_seed(3)
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    full = idx.numel() * model.config.vocab_size
    model.train()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(idx, targets, loop_counts=(2, 2))
            assert out.logits.dtype == torch.bfloat16
            saved = _saved_fp32_elements(lambda: lm_loss(out.logits, targets, chunk_rows=4))
            old_way = _saved_fp32_elements(lambda: F.cross_entropy(
                out.logits.float().reshape(-1, 64), targets.reshape(-1), ignore_index=-1))
        out.loss.backward()  # the model's own loss is the chunked one and trains
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    assert old_way >= full  # the check sees the fp32 copy the old loss kept...
    assert saved < full  # ...and the chunked loss keeps none (only a [B*T] log-normaliser)


# ------------------------------------------------------------------ every policy under bf16

def _settings(name: str) -> list[tuple[str, float | None, bool]]:
    """(label, value, decisions independent of precision): a threshold no step meets (every token runs
    k_max steps) and one every step meets (each token leaves at the rule's first chance)."""
    cls = get_policy_class(name)
    if name == "fixed":
        return [("k_max", None, True)]
    if cls.sweep_parameter == "patience":
        # patience k_max never fires; patience 1 fires when the top token repeats, precision-dependent
        return [("late", K_MAX[0], True), ("early", 1, False)]
    # minp_kl's filtered distributions can be equal bit for bit on consecutive bf16 steps (KL exactly 0,
    # under any tau): its late setting is precision-dependent too
    return [("late", 1e-30, name != "minp_kl"), ("early", 1e30 if cls.tau_max is None else cls.tau_max, True)]


def _options(name: str, model) -> dict:
    """The learned rule's gate (random weights: the rule's mechanics under bf16, not its quality)."""
    if name == "ouro":  # Ouro's rule with a random gate
        return {"gate": random_ouro_gate(model.config.d_model)}
    return {"gate": random_gate(model.n_groups, model.config.d_model)} if name == "learned" else {}


def _forward(model, idx, factory, dtype):
    with torch.no_grad(), _autocast(dtype):
        return model(idx, controller=factory(), noise=StateNoise.consecutive(0, 0, idx.shape[0]))


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_runs_under_bf16_on_the_packed_path_and_matches_fp32(model, name):
    torch.manual_seed(4)
    idx = torch.randint(0, 64, (2, 16))
    for label, value, exact in _settings(name):
        factory = controller_factory(name, value, K_MAX, lambda: model.readout, _options(name, model))
        wide, low = _forward(model, idx, factory, None), _forward(model, idx, factory, torch.bfloat16)
        assert low.logits.dtype == torch.bfloat16 and torch.isfinite(low.logits).all(), label
        for computed in low.computed:
            assert computed.min() >= 1 and computed.max() <= K_MAX[0], label
        if not exact:
            continue
        # same exits, same state handed on (its index), logits close, same winners
        assert all(torch.equal(a, b) for a, b in zip(wide.computed, low.computed, strict=False)), label
        assert all(torch.equal(a, b) for a, b in zip(wide.used, low.used, strict=False)), label
        a, b = wide.logits, low.logits.float()
        assert (a - b).abs().max() <= 0.05 * a.abs().max(), label
        top = a.topk(2, dim=-1).values
        clear = top[..., 0] - top[..., 1] > 0.5
        assert clear.float().mean() > 0.5, label  # the constructed case has clear winners
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear]), label
    if name not in ("fixed", "argmax_stable"):  # the early setting does exit early somewhere
        assert min(int(c.min()) for c in low.computed) < K_MAX[0]


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_generates_under_bf16_with_the_cache_as_fp32_would(model, name):
    """Greedy cached generation under bf16 picks, at every step, a token fp32 rates best up to the
    bf16 rounding of the logits (fp32 reads the generated text in one teacher-forced packed pass,
    the same computation as decoding it token by token), and fp32's own choice wherever it is clear."""
    torch.manual_seed(5)
    prompt = torch.randint(0, 64, (2, 4))
    for label, value, exact in _settings(name):
        factory = controller_factory(name, value, K_MAX, lambda: model.readout, _options(name, model))
        with _autocast(torch.bfloat16):
            tokens = generate(model, prompt, 8, temperature=0.0, controller_factory=factory,
                              noise=StateNoise.consecutive(0, 0, 2))
        assert tokens.shape == (2, 12), label
        if not exact:
            continue
        logits = _forward(model, tokens[:, :-1], factory, None).logits[:, 3:]  # (2, 8, V) fp32
        chosen = logits.gather(-1, tokens[:, 4:, None]).squeeze(-1)
        best = logits.max(dim=-1).values
        assert (best - chosen).max() <= 0.4, label  # about twice the largest bf16 logit error seen
        top = logits.topk(2, dim=-1).values
        clear = top[..., 0] - top[..., 1] > 0.4
        assert torch.equal(tokens[:, 4:][clear], logits.argmax(-1)[clear]), label
    with _autocast(torch.bfloat16):  # warm-started loops too
        generate(model, prompt, 4, temperature=0.0, controller_factory=factory, warm_start=True,
                 noise=StateNoise.consecutive(0, 0, 2))


def test_the_sweep_runs_every_policy_under_bf16_with_decode_latency(model):
    torch.manual_seed(6)
    windows = torch.randint(0, 64, (2, 21))
    config = SweepConfig(taus=(1e-2,), grid={"argmax_stable": (2,)}, k_max=(3,), batch_size=2, max_batches=1,
                         timing_batch_size=2, warmup=0, repeats=1, fixed_ladder=False, generate_prompt=4,
                         autocast="bf16")
    result = run_sweep(model, windows, config)
    assert result["config"]["generate_tokens"] == 16  # the default, the window leaves room for it
    assert {p["policy"] for p in result["points"]} == set(sweepable_policies())  # all but fixed and learned
    for entry in [result["reference"], *result["points"]]:
        assert entry["ms_per_token_generate"] > 0 and entry["ms_per_token_b1"] > 0
        assert len(entry["timing_samples"]["ms_per_token_generate"]) == 1
    assert "ms_per_token_generate" in result["summary"]["latency_definitions"]
    assert result["summary"]["latency_key"] == "ms_per_token_generate"


def test_decoded_rules_read_through_the_rest_of_the_model_under_bf16(model):
    """``--decode rest`` writes each reading into the group's fp32 output buffer (an index_copy)."""
    torch.manual_seed(7)
    windows = torch.randint(0, 64, (2, 13))
    config = SweepConfig(policies=("kl", "entropy_diff", "argmax_stable"), taus=(1e30,), grid={"argmax_stable": (1,)},
                         k_max=(3,), batch_size=2, max_batches=1, timing=False, fixed_ladder=False, decode="rest")
    wide = run_sweep(model, windows, config)
    low = run_sweep(model, windows, dataclasses.replace(config, autocast="bf16"))
    for a, b in zip(wide["points"], low["points"], strict=False):
        assert b["ppl"] == pytest.approx(a["ppl"], rel=0.05)
        if a["policy"] != "argmax_stable":  # KL and entropy change below 1e30 at step 2 whatever the precision
            assert a["mean_steps"] == b["mean_steps"] == [2.0, 2.0]


def test_default_decode_latency_fits_the_window():
    assert SweepConfig().generate_tokens_for(512) == 16
    assert SweepConfig(generate_prompt=16).generate_tokens_for(20) == 4
    assert SweepConfig(generate_prompt=16).generate_tokens_for(16) == 0  # no room: not timed
    assert SweepConfig(decode="rest").generate_tokens_for(512) == 0  # teacher-forced readings only
    assert SweepConfig(timing=False).generate_tokens_for(512) == 0
    assert SweepConfig(generate_tokens=0).generate_tokens_for(512) == 0
    assert SweepConfig(generate_tokens=40).generate_tokens_for(512) == 40
