"""The recurrent model: group specs, loops, caches, exits, truncated backprop."""

from __future__ import annotations

import conftest
import pytest
import torch

from rdepth.config import ModelConfig, get_preset, parse_groups, parse_loop_counts
from rdepth.errors import RdepthError
from rdepth.model import FixedController, RecurrentLM, sample_loop_counts, step_generator
from rdepth.model.decoder import Decoder
from rdepth.model.generation import generate


def tiny_config(**overrides) -> ModelConfig:
    """The shared tiny config (conftest) with the initial loop state at zero unless overridden."""
    return conftest.tiny_config(**{"init_state_scale": 0.0, **overrides})


def tiny_model(**overrides) -> RecurrentLM:
    return conftest.tiny_model(**{"init_state_scale": 0.0, **overrides})


BLOCKS = pytest.mark.parametrize("block", ["sandwich", "gpt2"])


# --------------------------------------------------------------- group specs
def test_parse_groups_paper_pattern():
    groups = parse_groups("4|5-6|7", 12)
    assert [g.layers for g in groups] == [(4,), (5, 6), (7,)]
    assert [g.name for g in groups] == ["4", "5-6", "7"]
    assert parse_groups("", 12) == ()


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("4|4", "disjoint"),
        ("5-6|4", "disjoint"),
        ("4-6|6", "disjoint"),
        ("6-4", "backwards"),
        ("12", "out of range"),
        ("-1", "not a layer index"),
        ("a", "not a layer index"),
        ("4||5", "not a layer index"),
    ],
)
def test_parse_groups_rejects(spec, fragment):
    with pytest.raises(RdepthError, match=fragment):
        parse_groups(spec, 12)


def test_config_validation_names_field():
    with pytest.raises(RdepthError, match="d_model"):
        ModelConfig(d_model=100, n_head=3)
    with pytest.raises(RdepthError, match="mean_loops"):
        ModelConfig(mean_loops=0.5)
    with pytest.raises(RdepthError, match="unknown preset"):
        get_preset("huge")
    with pytest.raises(RdepthError, match="unknown field"):
        ModelConfig.from_dict({"n_layers": 3})
    with pytest.raises(RdepthError, match="block must be one of sandwich, gpt2, peri, got 'llama'"):
        ModelConfig(block="llama")


def test_gpt2_block_computes_gpt2s_layer_by_hand():
    """x + attn(ln_1(x)), then + mlp(ln_2(.)), GELU-tanh, biases; no sqrt(d) embedding scale."""
    model = tiny_model(block="gpt2", groups="", n_layer=1)
    layer = model.layers[0]
    idx = torch.randint(0, 50, (1, 6))
    x = model.wte(idx) + model.wpe(torch.arange(6))
    assert torch.equal(model.embed(idx), x)
    h = torch.nn.functional.layer_norm(x, (16,), layer.norm_1.weight, layer.norm_1.bias, model.config.norm_eps)
    q, k, v = (h @ layer.attn.qkv.weight.T + layer.attn.qkv.bias).split(16, dim=-1)
    heads = lambda t: t.view(1, 6, 2, 8).transpose(1, 2)  # noqa: E731
    scores = heads(q) @ heads(k).transpose(-1, -2) / 8 ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(6, 6, dtype=torch.bool), 1), float("-inf"))
    y = (scores.softmax(-1) @ heads(v)).transpose(1, 2).reshape(1, 6, 16)
    x = x + y @ layer.attn.proj.weight.T + layer.attn.proj.bias
    h = torch.nn.functional.layer_norm(x, (16,), layer.norm_2.weight, layer.norm_2.bias, model.config.norm_eps)
    u = h @ layer.mlp.fc.weight.T + layer.mlp.fc.bias
    gelu = 0.5 * u * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (u + 0.044715 * u ** 3)))
    x = x + gelu @ layer.mlp.proj.weight.T + layer.mlp.proj.bias
    torch.testing.assert_close(layer(model.embed(idx)), x, rtol=0, atol=1e-12)


def test_parse_loop_counts():
    assert parse_loop_counts("5", 3) == (5, 5, 5)
    assert parse_loop_counts("1,2,3", 3) == (1, 2, 3)
    with pytest.raises(RdepthError, match="2 values for 3"):
        parse_loop_counts("1,2", 3)
    with pytest.raises(RdepthError, match=">= 1"):
        parse_loop_counts("0", 1)


def test_stages_follow_groups():
    model = RecurrentLM(get_preset("paper", n_layer=12, d_model=24, n_head=2, vocab_size=64))
    kinds = [(s.kind.value, s.layers) for s in model.stages]
    assert kinds == [
        ("single", (0, 1, 2, 3)), ("group", (4,)), ("group", (5, 6)), ("group", (7,)),
        ("single", (8, 9, 10, 11)),
    ]
    # Geiping et al.'s layout is the same config with one group.
    model = RecurrentLM(ModelConfig(n_layer=8, n_head=2, d_model=16, vocab_size=64, groups="2-5"))
    assert [(s.kind.value, s.layers) for s in model.stages] == [
        ("single", (0, 1)), ("group", (2, 3, 4, 5)), ("single", (6, 7))
    ]


# ------------------------------------------------------------------- loops
def test_parameters_shared_across_loop_steps():
    short = RecurrentLM(tiny_config(mean_loops=2.0))
    long = RecurrentLM(tiny_config(mean_loops=20.0))
    assert short.num_parameters() == long.num_parameters()
    assert short.state_dict().keys() == long.state_dict().keys()
    # The forward at count 3 is exactly three applications of the same step.
    model = tiny_model()
    idx = torch.randint(0, 50, (2, 8))
    states = {}

    def keep(group, step, state, active):
        states[(group, step)] = state.clone()

    model(idx, loop_counts=(3, 2), observer=keep)
    x = model.run_layers((0,), model.embed(idx))
    s = torch.zeros_like(x)
    for _ in range(3):
        s = model.loop_step(0, s, model.group_input(0, x))
    torch.testing.assert_close(s, states[(0, 3)], rtol=0, atol=0)


LOOP_STATES = pytest.mark.parametrize("loop_state", ["sandwich", "residual"])


def test_loop_state_steps_by_hand_and_the_default_is_unchanged():
    """loop_step by hand: 'sandwich' (the default) is layers(W_s s + W_e e), bit for bit as before the
    option existed; 'residual' is s + layers(W_s rmsnorm(s) + W_e e), with the same parameters."""
    torch.manual_seed(1)
    config = tiny_config()
    assert config.loop_state == "sandwich"
    model = RecurrentLM(config).eval()  # float32: bit-identity where it is hardest
    residual = RecurrentLM(config.replace(loop_state="residual")).eval()
    residual.load_state_dict(model.state_dict())  # no new parameters
    e = torch.randn(2, 7, 16)
    s = torch.randn(2, 7, 16)
    weight = model.adapters[0].weight
    with torch.no_grad():
        linear = torch.nn.functional.linear
        by_hand = model.run_layers((1,), linear(s, weight[:, :16]) + linear(e, weight[:, 16:]))
        assert torch.equal(model.loop_step(0, s, model.group_input(0, e)), by_hand)
        unsplit = model.run_layers((1,), torch.cat([s, e], -1) @ weight.T)  # the adapter on concat(s, e)
        torch.testing.assert_close(model.loop_step(0, s, model.group_input(0, e)), unsplit, rtol=1e-5, atol=1e-6)
        normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + config.norm_eps)
        expected = s + residual.run_layers((1,), normed @ weight[:, :16].T + e @ weight[:, 16:].T)
        torch.testing.assert_close(residual.loop_step(0, s, residual.group_input(0, e)), expected,
                                   rtol=1e-6, atol=1e-6)


def test_loop_state_is_validated_and_old_configs_load_as_the_default(tmp_path):
    from rdepth.run.checkpoint import load_model, save_checkpoint

    with pytest.raises(RdepthError, match="loop_state must be one of sandwich, residual"):
        tiny_config(loop_state="highway")
    old = tiny_config().to_dict()
    del old["loop_state"]  # a checkpoint written before the field existed
    assert ModelConfig.from_dict(old).loop_state == "sandwich"
    model = RecurrentLM(tiny_config(loop_state="residual"))
    save_checkpoint(tmp_path / "run", 3, model, model.config)
    loaded, config = load_model(tmp_path / "run")
    assert config.loop_state == "residual" and loaded.config.loop_state == "residual"


@BLOCKS
@LOOP_STATES
def test_dense_equals_packed_path(block, loop_state):
    model = tiny_model(block=block, init_state_scale=1.0, loop_state=loop_state)
    idx = torch.randint(0, 50, (3, 10))
    dense = model(idx, loop_counts=(4, 2), noise=torch.Generator().manual_seed(1))
    packed = model(idx, controller=FixedController((4, 2)), noise=torch.Generator().manual_seed(1))
    torch.testing.assert_close(dense.logits, packed.logits, rtol=0, atol=1e-12)
    assert all((c == k).all() for c, k in zip(packed.computed, (4, 2), strict=False))


@BLOCKS
@LOOP_STATES
def test_cached_decoding_equals_uncached(block, loop_state):
    model = tiny_model(block=block, loop_state=loop_state)
    idx = torch.randint(0, 50, (2, 14))
    full = model(idx, loop_counts=(5, 3)).logits
    decoder = Decoder(model, 2, loop_counts=(5, 3))
    pieces = [decoder.prefill(idx[:, :6])]
    for t in range(6, 14):
        pieces.append(decoder.step(idx[:, t : t + 1])[:, None])
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-10)
    assert decoder.length == 14


@BLOCKS
def test_generate_greedy_matches_uncached_argmax(block):
    model = tiny_model(block=block)
    prompt = torch.randint(0, 50, (1, 5))
    out = generate(model, prompt, 6, temperature=0)
    tokens = prompt
    for _ in range(6):
        logits = model(tokens).logits[:, -1]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, tokens)


class NormController:
    """Deterministic test controller: a token exits group g once the step norm of
    its update falls under tau (handing on the new state), at most k_max steps."""

    def __init__(self, tau: float, k_max: int):
        self.tau, self.k_max = tau, k_max

    def max_steps(self, group):
        return self.k_max

    def begin(self, group, state):
        pass

    def after_step(self, group, step, rows, prev, new):
        done = (new - prev).norm(dim=-1) < self.tau
        return done, new, torch.full_like(rows, step)


def _exit_tau(model, idx):
    """A threshold amid the step norms of step 3, so exits really vary: halfway between the two middle
    norms, never equal to one, so that no token sits on the threshold (where paths that sum in
    another order could decide it either way)."""
    norms = []

    def keep(group, step, state, active):
        norms.append(state.clone())

    model(idx, loop_counts=(8, 8), observer=keep)
    ordered = (norms[3] - norms[2]).norm(dim=-1).flatten().sort().values
    middle = ordered.numel() // 2
    return float((ordered[middle - 1] + ordered[middle]) / 2)


@BLOCKS
def test_exits_teacher_forced_equals_cached_and_batch_of_one(block):
    model = tiny_model(block=block)
    idx = torch.randint(0, 50, (3, 12))
    tau = _exit_tau(model, idx)
    forced = model(idx, controller=NormController(tau, 8))
    steps = torch.stack(forced.computed)
    assert steps.min() < steps.max(), "the threshold should make tokens exit at different steps"
    # cached, token by token
    decoder = Decoder(model, 3, controller_factory=lambda: NormController(tau, 8))
    logits, computed = [], []
    for t in range(12):
        logits.append(decoder.step(idx[:, t : t + 1])[:, None])
        computed.append(decoder.computed[:, :, None].clone())
    torch.testing.assert_close(torch.cat(logits, 1), forced.logits, rtol=0, atol=1e-10)
    assert torch.equal(torch.cat(computed, 2), steps)
    # batch of one
    for row in range(3):
        single = model(idx[row : row + 1], controller=NormController(tau, 8))
        torch.testing.assert_close(single.logits[0], forced.logits[row], rtol=0, atol=1e-10)
        assert torch.equal(torch.stack(single.computed)[:, 0], steps[:, row])


def test_exited_tokens_are_not_computed():
    model = tiny_model()
    idx = torch.randint(0, 50, (2, 12))
    tau = _exit_tau(model, idx)
    rows_seen = {}

    def count(module, args):
        rows_seen[module] = rows_seen.get(module, 0) + args[0].shape[0]

    hooks = [layer.register_forward_pre_hook(count) for layer in model.layers]
    out = model(idx, controller=NormController(tau, 8))
    for hook in hooks:
        hook.remove()
    for group, spec in enumerate(model.config.group_specs):
        expected = int(out.computed[group].sum())
        assert expected < 8 * idx.numel()
        for layer in spec.layers:
            assert rows_seen[model.layers[layer]] == expected


# ------------------------------------------------------- training schedule
def test_truncated_backprop_stops_gradients():
    model = RecurrentLM(tiny_config(backprop_depth=2, init_state_scale=1.0)).train()
    idx = torch.randint(0, 50, (2, 8))
    states = {}

    def keep(group, step, state, active):
        states[(group, step)] = state

    out = model(idx, targets=idx, loop_counts=(5, 1), observer=keep)
    # group 0 runs 5 steps: only the last 2 carry a graph
    assert [states[(0, k)].requires_grad for k in range(6)] == [False, False, False, False, True, True]
    assert states[(1, 1)].requires_grad
    out.loss.backward()
    assert model.adapters[0].weight.grad.abs().sum() > 0
    # Gradient equals a manual unroll whose first 3 steps are detached.
    model.zero_grad()
    x = model.run_layers((0,), model.embed(idx))
    with torch.no_grad():
        s = states[(0, 0)]
        for _ in range(3):
            s = model.loop_step(0, s, model.group_input(0, x))
    for _ in range(2):
        s = model.loop_step(0, s, model.group_input(0, x))
    s1 = model.loop_step(1, states[(1, 0)], model.group_input(1, s))
    logits = model.readout(model.run_layers((4,), s1))
    manual = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), idx.reshape(-1))
    torch.testing.assert_close(manual, out.loss)


def test_loop_count_schedule():
    config = tiny_config(mean_loops=12.0)
    draws = [sample_loop_counts(config, step_generator(0, step)) for step in range(3000)]
    values = torch.tensor(draws, dtype=torch.float64)
    assert values.min() >= 1
    assert abs(values.mean().item() - 12.0) < 0.4
    assert values.max() > 24  # heavy right tail of the lognormal rate
    # same (seed, step) -> same counts, on every rank
    assert sample_loop_counts(config, step_generator(0, 7)) == draws[7]
    assert sample_loop_counts(tiny_config(mean_loops=1.0), step_generator(0, 1)) == (1, 1)


def test_state_noise_is_keyed_by_sequence_and_position():
    """A row's initial state depends on its sequence id, position and group only: split
    batches (data-parallel ranks, other batch sizes) and cached decoding draw the same."""
    from rdepth.model.noise import StateNoise

    model = RecurrentLM(tiny_config(init_state_scale=1.0))
    inputs = torch.zeros(4, 6, 16)
    full = model.init_state(0, inputs, StateNoise.consecutive(3, 0, 4))
    lower = model.init_state(0, inputs[:2], StateNoise.consecutive(3, 0, 2))
    upper = model.init_state(0, inputs[2:], StateNoise(3, [2, 3]))
    assert torch.equal(torch.cat([lower, upper]), full)
    # positions 2..3 alone, as a decoding step after a 2-token prompt would ask for them
    tail = model.init_state(0, inputs[:, 2:4], StateNoise.consecutive(3, 0, 4), start=2)
    assert torch.equal(tail, full[:, 2:4])
    # other groups, sequences and seeds differ
    assert not torch.equal(model.init_state(1, inputs, StateNoise.consecutive(3, 0, 4)), full)
    assert not torch.equal(full[0], full[1])
    assert not torch.equal(model.init_state(0, inputs, StateNoise.consecutive(4, 0, 4)), full)
    # Geiping et al.: std sqrt(2/(5d)) times the embedding scale sqrt(d) = sqrt(2/5) per coordinate
    assert model.init_state_std == pytest.approx((2 / 5) ** 0.5)
    assert full.abs().max() <= 3 * model.init_state_std + 1e-6
    assert 0.8 < float(full.std() / model.init_state_std) < 1.2
    zero = RecurrentLM(tiny_config(init_state_scale=0.0)).init_state(0, inputs)
    assert torch.equal(zero, torch.zeros_like(inputs))


def test_block_size_enforced():
    model = tiny_model()
    with pytest.raises(RdepthError, match="block size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_loop_step_compiles_without_graph_breaks():
    """The hot path (one loop step) traces as one graph: no host syncs, no Python fallbacks."""
    model = RecurrentLM(tiny_config())
    step = torch.compile(model.loop_step, fullgraph=True, backend="eager")
    state, inputs = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    projected = model.group_input(1, inputs)
    torch.testing.assert_close(step(1, state, projected), model.loop_step(1, state, projected))


def test_regional_compilation_does_not_recompile_when_loop_counts_change():
    """The trainer compiles each layer: new loop counts reuse the graphs (grad and no-grad steps alike)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = RecurrentLM(tiny_config(backprop_depth=2)).train()
    for layer in model.layers:
        layer.compile(backend="eager")
    idx = torch.randint(0, 50, (2, 8))
    model(idx, idx, loop_counts=(3, 4)).loss.backward()  # steps with and without gradients
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    for counts in ((1, 6), (5, 2), (7, 7)):
        model(idx, idx, loop_counts=counts).loss.backward()
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()
