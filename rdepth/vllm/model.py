"""``RdepthForCausalLM`` for vLLM: an ``rdepth export`` folder served by vLLM at a fixed loop budget.

The model is rdepth's own :class:`~rdepth.model.RecurrentLM`, built from the folder's ``config.json`` and holding
its weights under their exported names; a token goes through it by rdepth's stage walk
(:class:`~rdepth.model.walk.StageWalk`: ``embed``, single-pass layers, each group's ``group_input``,
``init_state``, ``loop_step`` per step and ``hand_on``, then ``readout``), so every block family, loop state,
position kind and head is the model's own code. What vLLM adds is the attention: each (layer, loop step) that a
token runs, every single-pass layer once and every looped layer once per step of its group's budget, is one vLLM
``Attention`` with its own paged key/value cache, as rdepth's exact cache keeps one key per loop step (step k of a
looped layer attends to the earlier positions' step-k keys, what the dense forward computes). The block's own
projections make the queries, keys and values (its query/key bias and rotary positions included) and its output
projection reads the result: vLLM's attention replaces only the softmax over the cache.

The initial loop state of the token at position t is row t of rdepth's ``StateNoise(state_seed, [0])`` draw per
group (zero with ``init_state_scale`` 0): what ``rdepth generate --seed S`` and the exported model give a
sequence with id 0, whatever the batch. vLLM's model interface passes a token's position but nothing that names
its request, so the key is (seed, group, position), the seed chosen at launch.

Launch options (``hf_overrides``): ``loop_counts`` (N or [N, ...] per group; default the export's), ``state_seed``
and ``exit_policy`` (null to serve an export that names one at a fixed budget).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

from rdepth.errors import RdepthError
from rdepth.interop.hf_model import with_pad_columns
from rdepth.model.layers import CausalSelfAttention
from rdepth.model.loop import run_fixed
from rdepth.model.noise import StateNoise
from rdepth.model.recurrent import RecurrentLM
from rdepth.model.walk import StageWalk
from rdepth.vllm.support import check, model_config_of, served_loop_counts


def supported_head_sizes() -> list[int] | None:
    """The head sizes vLLM's attention backend takes on this platform, where it names them (its CPU backend)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return list(CPUAttentionBackend.get_supported_head_sizes())
    return None


class _Paged:
    """The attention context of one (loop step) call: the tokens' positions and which vLLM ``Attention`` each
    layer reads at this step. Passed where rdepth's layers take their ``attn`` argument."""

    def __init__(self, owner: RdepthForCausalLM, positions: torch.Tensor, step: int):
        self.owner, self.position, self.step = owner, positions, step

    def attention(self, layer: int) -> Attention:
        return self.owner.kv[self.owner.slot[(layer, self.step)]]


def _paged_attention(self: CausalSelfAttention, x: torch.Tensor, attn=None) -> torch.Tensor:
    """``CausalSelfAttention.forward`` with vLLM's paged attention over the tokens ``x`` ``[N, d]`` of a vLLM
    batch: the layer's own ``qkv``, query/key bias and rotation (``_position_qk`` at each token's position) and
    ``proj``; any other context runs the class's own forward."""
    if not isinstance(attn, _Paged):
        return type(self).forward(self, x, attn)
    rows, dim = x.shape
    q, k, v = self.qkv(x).view(rows, 3, self.n_head, self.head_dim).unbind(1)  # each (N, nh, hs)
    if self.qk_bias is not None or self.rotary is not None:
        q, k = self._position_qk(q, k, attn.position)
    y = attn.attention(self.layer_index)(q.reshape(rows, dim), k.reshape(rows, dim), v.reshape(rows, dim))
    return self.proj(y.view(rows, dim))


class _Walk(StageWalk):
    """The model's stage walk over a vLLM batch ``[N, d]`` (tokens of any requests, each at its position):
    single-pass layers at step 0, each group from its keyed initial state for its fixed count."""

    def __init__(self, owner: RdepthForCausalLM, positions: torch.Tensor):
        super().__init__(owner.model)
        self.owner, self.positions = owner, positions

    def context(self, step: int) -> _Paged:
        return _Paged(self.owner, self.positions, step)

    def start(self, group: int, inputs: torch.Tensor) -> torch.Tensor:
        return self.owner.initial_state(group, self.positions, inputs)

    def loop(self, group: int, state: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        model = self.model
        return run_fixed(state, self.owner.loop_counts[group],
                         lambda state, step: model.loop_step(group, state, projected, self.context(step)))


class RdepthForCausalLM(nn.Module):
    """vLLM's model class for ``architectures: ["RdepthForCausalLM"]`` (see the module)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check(config, supported_head_sizes())  # (the launch checked it already: rdepth.vllm.register)
        self.config = config
        model_config = model_config_of(config)
        self.loop_counts = served_loop_counts(config, model_config)
        self.state_seed = int(getattr(config, "state_seed", 0) or 0)
        self.vocab_width = int(config.vocab_size)  # the logits' width vLLM expects (the export's pad included)
        self.model = RecurrentLM(model_config)
        for layer in self.model.layers:  # vLLM's attention in each layer (an instance's forward, as checkpointing)
            layer.attn.forward = _paged_attention.__get__(layer.attn)
        # One vLLM Attention (its own KV cache) per (layer, step): step 0 for single-pass layers, 1..K per group.
        slots = []
        for stage in self.model.stages:
            steps = (0,) if stage.group is None else range(1, self.loop_counts[stage.group] + 1)
            slots += [(layer, step) for step in steps for layer in stage.layers]
        self.slot = {key: index for index, key in enumerate(slots)}
        head_dim, heads = model_config.head_dim, model_config.n_head
        base = f"{prefix}.kv" if prefix else "kv"
        self.kv = nn.ModuleList(
            Attention(heads, head_dim, head_dim**-0.5, num_kv_heads=heads, cache_config=vllm_config.cache_config,
                      quant_config=vllm_config.quant_config, prefix=f"{base}.{index}")
            for index in range(len(slots)))
        self._states: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}

    def initial_state(self, group: int, positions: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """``[N, d]``: each token's initial loop state of ``group``, rdepth's ``init_state`` of sequence 0 at the
        token's position (the whole table drawn once per device and dtype)."""
        key = (inputs.device, inputs.dtype)
        if key not in self._states:
            model = self.model
            span = torch.zeros(1, model.config.block_size, model.config.d_model, device=inputs.device,
                               dtype=inputs.dtype)
            noise = StateNoise(self.state_seed, [0])
            self._states[key] = [model.init_state(g, span, noise)[0] for g in range(model.n_groups)]
        return self._states[key][group][positions]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embedding (learned positions are added in :meth:`forward`, which has the positions)."""
        return self.model.embed_scale * self.model.wte(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The last stage's output ``[N, d]`` for the tokens of a vLLM batch (before the final norm and head)."""
        if inputs_embeds is None:
            x = self.model.embed(input_ids, positions=positions)
        else:
            x = inputs_embeds if self.model.wpe is None else inputs_embeds + self.model.wpe(positions)
        return _Walk(self, positions)(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The model's readout (final norm where the loop did not end with it, the head), with the export's pad
        column(s) at ``-inf``: the logits' width is the folder's ``vocab_size``."""
        return with_pad_columns(self.model.readout(hidden_states), self.vocab_width)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The folder's ``model.safetensors`` under its own names (``model.`` + rdepth's)."""
        parameters = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            target = parameters.get(name)
            if target is None or target.shape != tensor.shape:
                found = "no such weight" if target is None else f"shape {tuple(target.shape)}"
                raise RdepthError(f"rdepth vllm plugin: the folder's weight {name} {tuple(tensor.shape)} does not fit "
                                  f"the model its config.json describes ({found})")
            with torch.no_grad():
                target.copy_(tensor)
            loaded.add(name)
        return loaded
