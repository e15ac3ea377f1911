"""Model configuration: recurrence groups, loop schedule, presets.

A model has ``n_layer`` transformer layers. Some contiguous runs of layers form
*recurrence groups* that are applied in a loop; a layer in no group runs once.
Groups are written as ``"4|5-6|7"`` (0-based layer indices, ``a-b`` inclusive):
the paper's pattern on 12 layers, where layers 0-3 run before and 8-11 after.
Geiping et al.'s layout (2 prelude layers, one 4-layer core, 2 coda layers) is
``n_layer=8, groups="2-5"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from rdepth.errors import RdepthError
from rdepth.fields import option

# Upper limits that keep a typo from running until killed (a loop count of 1e9, a 1e8-token context).
MAX_LOOPS = 1024
MAX_BLOCK_SIZE = 65536
MAX_LAYERS = 1024  # far beyond any trained model; a layer count of 1e6 would build for minutes first
# Layer types RecurrentLM builds (rdepth.model.layers.BLOCKS): Geiping et al.'s sandwich block,
# GPT-2's pre-LayerNorm block, which imported GPT-2 models keep, and the "peri" block of Ouro (LoopLM):
# RMSNorm before each sub-layer and on its output, before the residual sum.
BLOCK_TYPES = ("sandwich", "gpt2", "peri")
# What a recurrence group's loop carries (RecurrentLM.loop_step): Geiping et al.'s state, replaced by
# the group's output each step, or a residual stream that each step adds the group's output to, or
# Ouro's (LoopLM): no adapter, the loop starts from its input and each step's output passes the final norm.
LOOP_STATES = ("sandwich", "residual", "looplm")
# Inductor modes rdepth compiles with (training layers and decoding pieces): none that captures CUDA
# graphs of its own (loop counts vary in training; the Decoder captures its graphs itself).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# Where a token's position enters (rdepth.model.layers): a learned embedding added to the token's, or
# rotary positions on each head's queries and keys (Huginn-0125 / raven: pairs of adjacent channels).
POSITION_TYPES = ("learned", "rotary")
# Which channels of a head rotary positions turn together: adjacent pairs (2i, 2i+1) (Huginn-0125 / raven)
# or the two halves' channels (i, i + hs/2) (rotate-half: Llama's, Ouro's).
ROPE_PAIRS = ("adjacent", "half")
# The MLP of a block: the block type's own (SiLU for sandwich, GELU-tanh for gpt2), or a gated SiLU
# (SwiGLU: silu(gate) * up from one fused input matrix, gate rows first; Huginn-0125 / raven).
MLP_TYPES = ("plain", "swiglu")


@dataclass(frozen=True)
class GroupSpec:
    """A contiguous run of layers looped together; ``end`` is inclusive."""

    start: int
    end: int

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(range(self.start, self.end + 1))

    @property
    def name(self) -> str:
        return str(self.start) if self.start == self.end else f"{self.start}-{self.end}"


def parse_groups(spec: str, n_layer: int) -> tuple[GroupSpec, ...]:
    """Parse ``"4|5-6|7"`` into group specs, checking range, order and overlap.

    An empty string means no recurrence (a plain transformer).
    """
    spec = spec.strip()
    if not spec:
        return ()
    groups: list[GroupSpec] = []
    for part in spec.split("|"):
        part = part.strip()
        try:
            if "-" in part:
                lo_text, hi_text = part.split("-", 1)
                lo, hi = int(lo_text), int(hi_text)
            else:
                lo = hi = int(part)
        except ValueError:
            raise RdepthError(
                f"bad group spec {spec!r}: {part!r} is not a layer index or a range like 5-6"
            ) from None
        if lo > hi:
            raise RdepthError(f"bad group spec {spec!r}: range {part!r} runs backwards")
        if lo < 0 or hi >= n_layer:
            raise RdepthError(
                f"bad group spec {spec!r}: layers {part!r} out of range 0-{n_layer - 1}"
            )
        if groups and lo <= groups[-1].end:
            raise RdepthError(
                f"bad group spec {spec!r}: groups must be disjoint and in increasing order "
                f"({groups[-1].name} then {part})"
            )
        groups.append(GroupSpec(lo, hi))
    return tuple(groups)


def parse_loop_counts(spec: str | int | list | tuple | None, n_groups: int) -> tuple[int, ...] | None:
    """Parse per-group loop counts: ``"12"`` (every group) or ``"8,12,4"`` (one per group)."""
    if spec is None:
        return None
    if isinstance(spec, int):
        values = [spec]
    elif isinstance(spec, (list, tuple)):
        values = list(spec)
    else:
        try:
            values = [int(v) for v in str(spec).split(",") if v.strip()]
        except ValueError:
            raise RdepthError(f"bad loop counts {spec!r}: expected N or N,N,... (integers)") from None
    if len(values) == 1:
        values = values * n_groups
    if len(values) != n_groups:
        raise RdepthError(
            f"bad loop counts {spec!r}: {len(values)} values for {n_groups} recurrence groups"
        )
    if any(int(v) < 1 for v in values):
        raise RdepthError(f"bad loop counts {spec!r}: every count must be >= 1")
    if any(int(v) > MAX_LOOPS for v in values):
        raise RdepthError(f"bad loop counts {spec!r}: every count must be <= {MAX_LOOPS}")
    return tuple(int(v) for v in values)


@dataclass
class ModelConfig:
    """Everything needed to build a :class:`rdepth.model.RecurrentLM`.

    Loop schedule (Geiping et al.): in training each group draws its loop count
    per forward pass from a lognormal-Poisson distribution with mean
    ``mean_loops`` and log-space spread ``loop_sigma``; gradients flow through
    the last ``backprop_depth`` steps only. In evaluation each group runs
    ``eval_loops`` steps (default: ``round(mean_loops)`` for every group).
    """

    n_layer: int = option(12, "transformer layers")
    n_head: int = option(12, "attention heads per layer")
    d_model: int = option(768, "model width")
    block_size: int = option(512, "context length in tokens")
    vocab_size: int = option(50257, "vocabulary size (taken from the prepared data)", cli=False)
    groups: str = option("4|5-6|7", "recurrence groups, e.g. '4|5-6|7' (0-based layers, a-b inclusive; '' for none)")
    mean_loops: float = option(12.0, "mean loop count per group in training (lognormal-Poisson)")
    loop_sigma: float = option(0.5, "log-space spread of the training loop count")
    backprop_depth: int = option(8, "loop steps that get gradients (truncated backprop)")
    init_state_scale: float = option(
        1.0, "std of the random initial loop state in units of sqrt(2/5) (Geiping et al.'s; 0: a zero state)")
    eval_loops: tuple[int, ...] | None = option(
        None, "evaluation loop counts: N or N,N,... per group", default_text="round(mean_loops)",
    )
    mlp_ratio: int = option(4, "MLP hidden width as a multiple of d_model")
    norm_eps: float = option(1e-6, "norm epsilon (RMSNorm; LayerNorm for gpt2 blocks)")
    block: str = option(
        "sandwich", "layer type: 'sandwich' (Geiping et al.: RMSNorm before each sub-layer and after each "
        "residual sum, no biases, SiLU MLP, token embedding times sqrt(d)), 'gpt2' (pre-LayerNorm with "
        "biases, GELU-tanh MLP: imported GPT-2 models) or 'peri' (Ouro: RMSNorm before each sub-layer and on "
        "its output before the residual sum, no biases, the token embedding unscaled)")
    tokenizer: str = option("gpt2", "tokenizer spec (taken from the prepared data)", cli=False)
    loop_state: str = option(
        "sandwich", "what a loop carries: 'sandwich' (Geiping et al.: s <- layers(adapter(s, e)), the "
        "state replaced each step), 'residual' (a residual stream: s <- s + layers(adapter(rmsnorm(s), e)), "
        "pre-norm, no new parameters) or 'looplm' (Ouro: s_0 = e, s <- norm_f(layers(s)), no adapter; one "
        "group ending at the last layer, a zero initial state, the head reads the state as it is)")

    positions: str = option(
        "learned", "positional encoding: 'learned' (an embedding per position, added to the token's) or "
        "'rotary' (each head's queries and keys rotated by the absolute position; no position weights)")
    rope_base: float = option(10000.0, "rotary positions: the base of the rotation frequencies")
    rope_pairs: str = option(
        "adjacent", "rotary positions: the channels turned together, 'adjacent' (2i, 2i+1; Huginn-0125) or "
        "'half' (i, i + head_dim/2, rotate-half; Llama, Ouro)")
    mlp: str = option(
        "plain", "MLP: 'plain' (the block type's activation: SiLU for sandwich, GELU-tanh for gpt2) or "
        "'swiglu' (silu(gate) * up, one fused input matrix with the gate rows first)")
    mlp_hidden: int | None = option(None, "MLP hidden width (each of gate and up for swiglu)",
                                    default_text="mlp_ratio * d_model")
    qk_bias: bool = option(False, "a learned bias on each head's queries and keys (before rotary positions)")
    handoff_norm: bool = option(
        False, "apply the final norm (norm_f, the readout's own) to the state each recurrence group hands "
        "on, before the next stage (Huginn-0125 / raven)")
    tie_head: bool = option(
        True, "the output head is the token embedding (tied); false: a head matrix of its own (Ouro)")
    exit_gate: bool = option(
        False, "a learned exit gate on the loop state, sigmoid(w . s + b) per step (Ouro's early_exit_gate; read "
        "by the 'ouro' exit rule)")

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_ranges()
        self._check_choices()
        _ = self.group_specs  # validates the group string
        self._resolve_eval_loops()

    def _check_sizes(self) -> None:
        """The integer sizes: positive, heads dividing the width, layers and context under their caps."""
        for name in ("n_layer", "n_head", "d_model", "block_size", "vocab_size", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RdepthError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise RdepthError(
                f"model config: d_model={self.d_model} is not divisible by n_head={self.n_head}"
            )
        if self.n_layer > MAX_LAYERS:
            raise RdepthError(f"model config: n_layer must be <= {MAX_LAYERS}, got {self.n_layer!r}")
        if self.block_size > MAX_BLOCK_SIZE:
            raise RdepthError(f"model config: block_size must be <= {MAX_BLOCK_SIZE}, got {self.block_size!r}")
        hidden = self.mlp_hidden
        if hidden is not None and (not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1):
            raise RdepthError(f"model config: mlp_hidden must be a positive integer, got {hidden!r}")
        if self.positions == "rotary" and self.head_dim % 2:
            raise RdepthError(f"model config: rotary positions need an even head_dim, got {self.head_dim} "
                              f"(d_model={self.d_model}, n_head={self.n_head})")

    def _check_ranges(self) -> None:
        """The loop schedule's and the norm's numbers inside their intervals (written so NaN fails)."""
        if not (1 <= self.mean_loops <= MAX_LOOPS):
            raise RdepthError(f"model config: mean_loops must be in 1..{MAX_LOOPS}, got {self.mean_loops!r}")
        if not (0 <= self.loop_sigma <= 10):
            raise RdepthError(f"model config: loop_sigma must be in [0, 10], got {self.loop_sigma!r}")
        if not (0 < self.norm_eps < 1):
            raise RdepthError(f"model config: norm_eps must be in (0, 1), got {self.norm_eps!r}")
        if not isinstance(self.backprop_depth, int) or not 1 <= self.backprop_depth <= MAX_LOOPS:
            raise RdepthError(
                f"model config: backprop_depth must be a positive integer, got {self.backprop_depth!r}"
            )
        if not (1 < self.rope_base < 1e12):
            raise RdepthError(f"model config: rope_base must be in (1, 1e12), got {self.rope_base!r}")
        if not (0 <= self.init_state_scale < 1e6):
            raise RdepthError(
                f"model config: init_state_scale must be >= 0, got {self.init_state_scale!r}"
            )

    def _check_choices(self) -> None:
        """The named choices: the layer type, what a loop carries, the positions and the MLP."""
        if self.block not in BLOCK_TYPES:
            raise RdepthError(f"model config: block must be one of {', '.join(BLOCK_TYPES)}, got {self.block!r}")
        if self.positions not in POSITION_TYPES:
            raise RdepthError(
                f"model config: positions must be one of {', '.join(POSITION_TYPES)}, got {self.positions!r}")
        if self.rope_pairs not in ROPE_PAIRS:
            raise RdepthError(f"model config: rope_pairs must be one of {', '.join(ROPE_PAIRS)}, got {self.rope_pairs!r}")
        if self.mlp not in MLP_TYPES:
            raise RdepthError(f"model config: mlp must be one of {', '.join(MLP_TYPES)}, got {self.mlp!r}")
        for name in ("qk_bias", "handoff_norm", "tie_head", "exit_gate"):
            if not isinstance(getattr(self, name), bool):
                raise RdepthError(f"model config: {name} must be true or false, got {getattr(self, name)!r}")
        if self.loop_state not in LOOP_STATES:
            raise RdepthError(
                f"model config: loop_state must be one of {', '.join(LOOP_STATES)}, got {self.loop_state!r}")
        if self.loop_state == "looplm":
            self._check_looplm()

    def _check_looplm(self) -> None:
        """``loop_state="looplm"`` (Ouro): the loop's first step reads its input in place of a zero state,
        and the head reads the last step's (normed) state, so one group ending at the last layer, a zero
        initial state and no second final norm on the hand-off."""
        specs = parse_groups(self.groups, self.n_layer)
        if len(specs) != 1 or specs[0].end != self.n_layer - 1:
            raise RdepthError(f"model config: loop_state 'looplm' needs one recurrence group ending at the last "
                              f"layer {self.n_layer - 1}, got groups {self.groups!r}")
        if self.init_state_scale != 0:
            raise RdepthError("model config: loop_state 'looplm' starts each loop from its input: init_state_scale "
                              f"must be 0, got {self.init_state_scale!r}")
        if self.handoff_norm:
            raise RdepthError("model config: loop_state 'looplm' already ends each step with the final norm: "
                              "handoff_norm must be false")

    def _resolve_eval_loops(self) -> None:
        """``eval_loops`` parsed into one count per group (refused when the model has no groups)."""
        if self.eval_loops is None:
            return
        spec = self.eval_loops
        given = spec if isinstance(spec, (list, tuple)) else [v for v in str(spec).split(",") if v.strip()]
        if not self.group_specs and len(given):
            raise RdepthError(f"model config: eval_loops {self.eval_loops!r} given, but the model has no "
                              "recurrence groups (groups ''): drop it or give --groups")
        self.eval_loops = parse_loop_counts(self.eval_loops, len(self.group_specs))

    @property
    def group_specs(self) -> tuple[GroupSpec, ...]:
        """The parsed ``groups`` (parsed once per value of ``groups``/``n_layer``)."""
        key = (self.groups, self.n_layer)
        cached = self.__dict__.get("_group_specs")
        if cached is None or cached[0] != key:
            cached = (key, parse_groups(self.groups, self.n_layer))
            self.__dict__["_group_specs"] = cached
        return cached[1]

    @property
    def n_groups(self) -> int:
        return len(self.group_specs)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def hidden_width(self) -> int:
        """The MLP's hidden width (``mlp_hidden``, else ``mlp_ratio * d_model``)."""
        return self.mlp_hidden if self.mlp_hidden is not None else self.mlp_ratio * self.d_model

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rounded up to a multiple of 64 (faster matmuls; extra rows unused)."""
        return int(math.ceil(self.vocab_size / 64) * 64)

    @property
    def default_eval_loops(self) -> tuple[int, ...]:
        if self.eval_loops is not None:
            return tuple(self.eval_loops)
        return (max(1, round(self.mean_loops)),) * self.n_groups

    @property
    def unrolled_depth(self) -> float:
        """Layer applications per token at the mean loop count (for the scaled init)."""
        looped = sum(len(g.layers) for g in self.group_specs)
        return (self.n_layer - looped) + self.mean_loops * looped

    @property
    def weight_count(self) -> int:
        """Weights of the model, approximately (attention and MLP matrices, the groups' adapters,
        the embeddings): what :func:`check_fits_memory` sizes before anything is allocated."""
        d = self.d_model
        positions = self.block_size if self.positions == "learned" else 0
        adapters = 0 if self.loop_state == "looplm" else self.n_groups * 2 * d * d
        head = 0 if self.tie_head else self.padded_vocab_size * d
        return int(self.n_layer * (4 * d + 3 * self.hidden_width) * d + adapters
                   + (self.padded_vocab_size + positions) * d + head)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if data["eval_loops"] is not None:
            data["eval_loops"] = list(data["eval_loops"])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        from rdepth.io import dataclass_from_dict

        return dataclass_from_dict(cls, data, "model config")

    def replace(self, **changes: Any) -> ModelConfig:
        return ModelConfig.from_dict({**self.to_dict(), **changes})


# Named presets. ``paper`` is the paper's exact model (§2, Appendix B).
PRESETS: dict[str, dict[str, Any]] = {
    "paper": dict(
        n_layer=12, n_head=12, d_model=768, block_size=512, vocab_size=50257,
        groups="4|5-6|7", mean_loops=12.0, backprop_depth=8, tokenizer="gpt2",
    ),
    # The paper's layout at about a billion parameters (the width and heads of a 1.3B GPT): a
    # six-layer prelude, the paper's three looped groups, a six-layer coda. Its training state is
    # 14 GiB in float32 before activations: sized for rdepth train --parallel fsdp (docs/distributed.md).
    "1b": dict(
        n_layer=16, n_head=16, d_model=2048, block_size=1024, vocab_size=50257,
        groups="6|7-8|9", mean_loops=12.0, backprop_depth=8, tokenizer="gpt2",
    ),
    # A scaled-down paper model for one GPU: same layout, narrower, fewer loops.
    "small": dict(
        n_layer=12, n_head=8, d_model=512, block_size=512, vocab_size=50257,
        groups="4|5-6|7", mean_loops=8.0, backprop_depth=4, tokenizer="gpt2",
    ),
    # Trains to something meaningful on 2 CPU cores in minutes: three groups like
    # the paper (a self-loop, a paired loop, a self-loop) between one prelude and
    # one coda layer, a small byte-level BPE vocabulary.
    "tiny": dict(
        n_layer=6, n_head=4, d_model=128, block_size=128, vocab_size=4096,
        groups="1|2-3|4", mean_loops=4.0, backprop_depth=3, tokenizer="bpe:4096",
    ),
    # Huginn-0125's architecture (Geiping et al.; what rdepth.interop.hf_raven imports) at the tiny preset's width:
    # a 2-layer prelude, a 4-layer sandwich core looped 16 times on average, a 2-layer coda, rotary positions, a
    # gated MLP, the query/key bias and the final norm on the hand-off. A deep loop that trains on 2 CPU cores
    # (about 18 minutes for the text demo's 500 steps).
    "huginn_tiny": dict(
        n_layer=8, n_head=4, d_model=128, block_size=128, vocab_size=4096, groups="2-5", mean_loops=16.0,
        backprop_depth=4, tokenizer="bpe:4096", block="sandwich", positions="rotary", mlp="swiglu", mlp_hidden=384,
        handoff_norm=True, loop_state="sandwich", qk_bias=True, rope_base=50_000.0, eval_loops=(16,),
    ),
    # A reasoning-task model (rdepth.tasks): one prelude layer and one looped layer, a 64-token
    # context (one 16-node pointer-chasing problem), the task vocabulary. The demo's model before issue 38.
    "task": dict(
        n_layer=2, n_head=4, d_model=128, block_size=64, vocab_size=42,
        groups="1", mean_loops=6.0, backprop_depth=4, tokenizer="task:chase",
    ),
    # The demo's reasoning-task model (issue 38): the loop is the whole model, one looped layer and no
    # single-pass layer (the adapter reads the embedding, the head the hand-off), so a loop step is
    # nearly all of a token's time and early exit saves wall time; otherwise as ``task``.
    "task_loop": dict(
        n_layer=1, n_head=4, d_model=128, block_size=64, vocab_size=42,
        groups="0", mean_loops=6.0, backprop_depth=4, tokenizer="task:chase",
    ),
}


def machine_memory_bytes() -> int | None:
    """Memory this process may use: the machine's physical memory, or its cgroup's limit when lower
    (None when neither can be read)."""
    import os

    limits = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            limits.append(int(text))
    return min(limits) if limits else None


def check_fits_memory(config: ModelConfig, what: str = "model config", copies: int = 1) -> None:
    """A one-line error, before anything is allocated, when ``copies`` float32 copies of the model's
    weights (1 to evaluate; 4 to train: weights, gradients and Adam's two moments) exceed the memory
    of this machine (:func:`machine_memory_bytes`). Names the fields that set the size."""
    need = 4 * copies * config.weight_count
    have = machine_memory_bytes()
    if have is None or need <= have:
        return
    gib = 2**30
    raise RdepthError(
        f"{what}: a model with n_layer={config.n_layer}, d_model={config.d_model}, vocab_size={config.vocab_size} "
        f"has about {config.weight_count:,} weights and needs about {need / gib:,.1f} GiB "
        f"{'to train' if copies > 1 else 'for its weights'}, more than this machine's {have / gib:,.1f} GiB of "
        "memory: choose smaller sizes")


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """Build a named preset, with field overrides (``get_preset("tiny", n_layer=8)``)."""
    if name not in PRESETS:
        raise RdepthError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    return ModelConfig.from_dict({**PRESETS[name], **overrides})


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(ModelConfig)]

