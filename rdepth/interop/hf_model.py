"""The Hugging Face wrapper around :class:`rdepth.model.RecurrentLM` (shipped as ``modeling_rdepth.py``).

:func:`rdepth.interop.source.modeling_source` bundles this file with the rdepth
modules it imports into one self-contained file, so an exported folder loads with
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` without rdepth
installed. The wrapper adds no computation: ``forward`` calls ``RecurrentLM``,
dense for a plain call (packed rows under an exit policy), and rdepth's one decoder
(:class:`rdepth.model.decoder.Decoder`, over its key/value cache) when called with a cache
or ``use_cache=True``; ``generate`` runs rdepth's one decoder (:class:`rdepth.model.decoder.Decoder`,
exact under recurrence, as ``rdepth generate``) for greedy and sampled decoding,
and hands anything it does not cover (beam search, top-p, logits processors,
streamers, dict outputs) to transformers' own loop over ``forward``.

Per-call arguments of ``forward`` and ``generate``:

- ``loop_counts``: N, [N, N, ...] or "N:N:..." per group (default ``config.loop_counts``);
- ``state_seed``: seed of the initial loop state (default ``config.state_seed``);
- ``sequence_ids``: one id per batch row keying that row's initial-state draw
  (default 0 for every row, so a row's output does not depend on its batch);
- ``exit_policy``: per-token early exit, ``{"name": "acceleration", "tau": 1e-3,
  "k_max": 12}`` (any rule of :mod:`rdepth.exits.policies`, its options as more
  keys; ``k_max`` one cap or one per group; decoded rules read the model's head);
  default ``config.exit_policy``; ``False`` turns a configured one off for a call.
  With a policy, ``loop_counts`` is unused: each token loops until its rule stops it.

Padding: a row's ones in ``attention_mask`` must be contiguous (left or right padding).
``forward`` shifts each row so its real tokens start at position 0 (learned positions:
a token's position is its place among the row's real tokens), runs, and shifts the
logits back, so a padded row's real logits equal the unpadded row's. ``generate``
takes left-padded prompts: rows with the same real length decode together through
rdepth's decoder, so each row's tokens equal its unpadded generation. rdepth's cache
(``use_cache`` in transformers' own loop) takes left padding the same way: a decoder per group of rows
of one real length (right padding is refused with the cache). Beam search runs without the cache
(``use_cache=False``; the cache is not reordered, and asking for both is refused). A sequence longer than
``block_size`` (its positions end there) is refused with a message, in ``forward`` and before
``generate`` starts. ``output_hidden_states`` works with and without the cache (with it, the dense
forward of the sequence so far gives the new tokens' states); attention weights are never returned
(asking is refused). Gradient (activation) checkpointing recomputes each layer application of the dense
forward, every loop step's included, in the backward. The attention is torch's
``scaled_dot_product_attention`` whatever ``attn_implementation`` names (``sdpa`` and ``eager`` are
accepted: the same maths).

The pad token: the export's own, ``config.pad_token_id`` = the model's vocabulary size, one past it (not
the end token, so transformers infers the attention mask from it, and processors that read the input
ids, such as ``repetition_penalty``, never mistake pads for end tokens). The model reads a pad as the end
token (the pads' outputs are never read by real tokens), and the logits gain one column for it,
``-inf``, so every id the tokenizer gives indexes the logits (transformers' processors take
``scores[:, input_ids]``), the pad is never generated, and softmax over the real vocabulary is
unchanged; a label equal to the pad id is ignored (as -100). After ``resize_token_embeddings`` past the
pad id the pad is an ordinary token of the vocabulary.

Versions: transformers 4.46 to the newest (see ``configuration_rdepth.py``). The cache
travels as ``cache`` from 5.24 and as ``past_key_values`` before (:data:`CACHE_FIELD`,
detected from the output class); ``forward`` takes either name.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from rdepth.config import ModelConfig, parse_loop_counts
from rdepth.exits.controller import PolicyController, controller_factory
from rdepth.exits.gate import ExitGate
from rdepth.interop.hf_config import RdepthConfig, model_vocab_size
from rdepth.model.decoder import Decoder
from rdepth.model.noise import StateNoise
from rdepth.model.recurrent import RecurrentLM

# The output field (and generation keyword) that carries the cache: "cache" from transformers 5.24,
# "past_key_values" before.
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} \
    else "past_key_values"


@dataclasses.dataclass
class RdepthCausalLMOutput(CausalLMOutputWithPast):
    """transformers' causal-LM output with the loop's iterates: ``loop_states``, per recurrence group
    ``[K + 1, B, T, d]`` (the start state and each loop step's iterate), with ``output_hidden_states``."""

    loop_states: tuple[torch.Tensor, ...] | None = None


def model_config_of(config: RdepthConfig) -> ModelConfig:
    """The rdepth model config held in a Hugging Face config (the fields of ModelConfig)."""
    values = {field.name: getattr(config, field.name) for field in dataclasses.fields(ModelConfig)}
    values["vocab_size"] = model_vocab_size(config)  # less the export's own pad token
    if values["eval_loops"] is not None:
        values["eval_loops"] = tuple(values["eval_loops"])
    return ModelConfig(**values)


class RdepthCache:
    """rdepth's cache for one ``generate`` call: per group of rows of one real (unpadded) length, the decoder
    that holds their key/value cache (a left-padded batch decodes each row from its first real token, as
    that row alone); the budget (fixed counts or an exit policy) it was made for; the positions seen,
    padding included (what transformers' loop counts)."""

    is_compileable = False
    is_linear = (False,)
    is_croppable = False

    def __init__(self, groups: list[tuple[torch.Tensor, Decoder]], budget: tuple):
        self.groups = groups
        self.budget = budget
        self.length = 0
        self.tokens: torch.Tensor | None = None  # [B, length]: what output_hidden_states re-reads

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


def padding_offsets(attention_mask: torch.Tensor | None, cached: bool) -> torch.Tensor | None:
    """Per row, the index of its first real token ``[B]`` (None: no padding at all).

    A row's ones must be contiguous (left padding, right padding or both); rdepth's cache takes left padding
    only (``cached``: a row's last token must be real)."""
    if attention_mask is None or attention_mask.ndim != 2:
        return None
    mask = attention_mask.bool()
    if bool(mask.all()):
        return None
    if cached and not bool(mask[:, -1].all()):
        raise ValueError("rdepth's key/value cache takes left padding only (a row's last token real): pad on "
                         "the left (tokenizer.padding_side = 'left'), or pass use_cache=False")
    positions = torch.arange(mask.shape[1], device=mask.device)
    first = torch.where(mask, positions, mask.shape[1]).min(dim=1).values.clamp(max=mask.shape[1] - 1)
    count = mask.sum(dim=1)
    contiguous = (mask == ((positions >= first[:, None]) & (positions < (first + count)[:, None]))).all()
    if not bool(contiguous):
        raise ValueError("rdepth models take padded rows whose attention_mask ones are contiguous "
                         "(left or right padding), not gaps inside a row")
    return first


def shift_rows(tensor: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Row b of ``tensor`` ``[B, T, ...]`` rotated left by ``shifts[b]`` along T (negative: right)."""
    length = tensor.shape[1]
    index = (torch.arange(length, device=tensor.device)[None, :] + shifts.to(tensor.device)[:, None]) % length
    index = index.view(*index.shape, *([1] * (tensor.ndim - 2))).expand_as(tensor)
    return tensor.gather(1, index)


def with_pad_columns(logits: torch.Tensor, width: int) -> torch.Tensor:
    """``logits`` ``[..., V]`` widened to ``[..., width]`` with ``-inf`` columns (ids past the vocabulary:
    never predicted; softmax over the first V columns unchanged)."""
    if width <= logits.shape[-1]:
        return logits
    return F.pad(logits, (0, width - logits.shape[-1]), value=float("-inf"))


def check_length(length: int, block_size: int, what: str) -> None:
    if length > block_size:
        raise ValueError(f"{what} is {length} positions; this rdepth model reads at most block_size = "
                         f"{block_size} (its positions end there): shorten the prompt or max_new_tokens")


class RdepthForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = RdepthConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["SandwichBlock", "GPT2Block"]
    # save_pretrained copies a class's code when it is marked for an auto class; transformers 4.46
    # does not mark a class it loaded from remote code, so the exported module marks itself (rdepth's
    # own module, which imports rdepth, is never copied).
    _auto_class = None if __name__.startswith("rdepth.") else "AutoModelForCausalLM"
    # activation checkpointing: each layer application of the dense forward (loop steps included) is
    # recomputed in the backward (:meth:`_set_gradient_checkpointing`)
    supports_gradient_checkpointing = True
    # every attention is torch's scaled_dot_product_attention (rdepth.model.layers): "sdpa" names what runs
    _supports_sdpa = True

    def __init__(self, config: RdepthConfig):
        super().__init__(config)
        self.model = RecurrentLM(model_config_of(config))
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        if isinstance(module, RecurrentLM):
            module.reset_parameters()  # rdepth's own initialisation (weights are then loaded over it)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1, **kwargs) -> None:
        """transformers' ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable`` (and their
        ``disable``): with ``enable``, every ``every_n_layers``-th layer's application in a dense forward
        that records gradients (attention without a cache) runs under ``gradient_checkpointing_func`` (torch's
        ``checkpoint``): its activations are recomputed in the backward, at every loop step of a looped
        layer. The model's outputs and gradients are unchanged."""
        if gradient_checkpointing_func is None:
            from functools import partial

            from torch.utils.checkpoint import checkpoint

            gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
        self.gradient_checkpointing = bool(enable)
        for index, layer in enumerate(self.model.layers):
            layer.__dict__.pop("forward", None)  # the class's own forward again
            if enable and index % max(int(every_n_layers), 1) == 0:
                layer.forward = _checkpointed(layer, gradient_checkpointing_func)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is rdepth's own (one key/value per loop step)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.wte

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.wte = value

    def get_output_embeddings(self) -> None:
        # The head is the token embedding itself (RecurrentLM.readout: logits = norm(x) @ wte.weight^T,
        # config.tie_word_embeddings = True): there is no second matrix to tie or resize.
        return None

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> torch.nn.Embedding:
        """``new_num_tokens`` tokens (the head follows: it is the embedding). New rows start at the mean of
        the old real rows (``mean_resizing``, as transformers does) or at rdepth's initialisation; the
        embedding keeps rdepth's padding to a multiple of 64 rows, so the saved folder reloads.
        ``pad_to_multiple_of`` rounds ``new_num_tokens`` up first."""
        old = self.model.wte
        if new_num_tokens is None:
            return old
        if self.model.head is not None:  # tie_head false (an imported Ouro): the head would keep its rows
            raise ValueError("resize_token_embeddings: this model's head is a matrix of its own (tie_head false); "
                             "resizing the embedding alone would leave the logits' width as it is")
        if pad_to_multiple_of:
            new_num_tokens = -(-int(new_num_tokens) // int(pad_to_multiple_of)) * int(pad_to_multiple_of)
        old_tokens = self.model.config.vocab_size
        config = dataclasses.replace(self.model.config, vocab_size=int(new_num_tokens))
        new = torch.nn.Embedding(config.padded_vocab_size, old.embedding_dim, device=old.weight.device,
                                 dtype=old.weight.dtype)
        with torch.no_grad():
            keep = min(old_tokens, int(new_num_tokens))
            new.weight.zero_()
            new.weight[:keep] = old.weight[:keep]
            if new_num_tokens > old_tokens:
                added = new.weight[old_tokens:int(new_num_tokens)]
                if mean_resizing:
                    added.copy_(old.weight[:old_tokens].float().mean(dim=0).to(added.dtype).expand_as(added))
                else:
                    torch.nn.init.normal_(added, 0.0, self.model.base_std)
        new.weight.requires_grad_(old.weight.requires_grad)
        self.model.wte = new
        self.model.config = config
        # the export's own pad token stays one past the vocabulary only while it lies just past it
        extra = getattr(self.config, "pad_token_id", None) == int(new_num_tokens)
        self.config.extra_pad_token = extra
        self.config.vocab_size = int(new_num_tokens) + extra
        if hasattr(self, "vocab_size"):
            self.vocab_size = self.config.vocab_size
        return new

    # -------------------------------------------------------------- settings
    def pad_past_vocabulary(self) -> int | None:
        """``config.pad_token_id`` where it lies past the model's vocabulary (the export's own pad token),
        else None (no pad id, or one the vocabulary holds, e.g. after ``resize_token_embeddings``)."""
        pad = getattr(self.config, "pad_token_id", None)
        if not isinstance(pad, int) or pad < self.model.config.vocab_size:
            return None
        return pad

    def read_pads_as_end(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` with the pad id (past the vocabulary: it has no embedding) read as the end token."""
        pad = self.pad_past_vocabulary()
        if pad is None:
            return input_ids
        end = self.config.eos_token_id
        end = end[0] if isinstance(end, (list, tuple)) else end
        return input_ids.masked_fill(input_ids == pad, 0 if end is None else int(end))

    def resolve_loop_counts(self, loop_counts: Sequence[int] | int | str | None) -> tuple[int, ...] | None:
        """Per-call counts, else ``config.loop_counts``, else the model's eval counts
        (in training mode with neither: rdepth's random training draw, ``None``)."""
        if loop_counts is None:
            loop_counts = self.config.loop_counts
        if loop_counts is None:
            return None if self.training else self.model.config.default_eval_loops
        if isinstance(loop_counts, torch.Tensor):
            loop_counts = loop_counts.tolist()
        if isinstance(loop_counts, str):  # "3:2" as well as "3,2" (lm-eval splits --model_args on commas)
            loop_counts = loop_counts.replace(":", ",")
        return parse_loop_counts(loop_counts, self.model.n_groups)

    def exit_controller(self, exit_policy: dict | bool | None) -> PolicyController | None:
        """A fresh controller for the per-call or configured exit policy (None: fixed loop counts)."""
        spec = self.config.exit_policy if exit_policy is None or exit_policy is True else exit_policy
        if not spec:
            return None
        options = dict(spec)
        name = options.pop("name", None)
        if not name:
            raise ValueError(f"exit_policy needs a 'name' (a rule of rdepth.exits.policies), got {spec!r}")
        k_max = options.pop("k_max", 32)
        k_max = int(k_max) if isinstance(k_max, (int, float)) else tuple(int(k) for k in k_max)
        if name == "learned" and isinstance(options.get("gate"), str):
            options["gate"] = self.exit_gate(options["gate"])
        if name == "ouro" and options.get("gate") in (None, "model"):  # Ouro's gate is in the model
            options["gate"] = self.model
        return controller_factory(name, options.pop("tau", None), k_max, lambda: self.model.readout, options)()

    def exit_gate(self, file: str) -> ExitGate:
        """The learned exit rule's gate exported beside the weights (``file`` in the model's folder), read
        once."""
        path = os.path.join(self.name_or_path or ".", file)
        cached = getattr(self, "_exit_gate", None)
        if cached is None or cached[0] != path:
            from safetensors.torch import load_file

            if not os.path.isfile(path):
                raise ValueError(f"exit_policy learned: no exit gate {file!r} in {self.name_or_path!r} (export the "
                                 "run with rdepth export --exit-policy learned after rdepth gate)")
            tensors = load_file(path)
            self._exit_gate = (path, ExitGate(tensors["weight"], tensors["bias"], {}, path))
        return self._exit_gate[1]

    def state_noise(self, batch: int, state_seed: int | None, sequence_ids) -> StateNoise:
        seed = self.config.state_seed if state_seed is None else int(state_seed)
        if sequence_ids is None:
            sequence_ids = [0] * batch
        return StateNoise(seed, sequence_ids)

    # --------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: RdepthCache | None = None,
        labels: torch.LongTensor | None = None,
        past_key_values: RdepthCache | None = None,
        use_cache: bool | None = None,
        loop_counts: Sequence[int] | int | str | None = None,
        state_seed: int | None = None,
        sequence_ids: Sequence[int] | None = None,
        exit_policy: dict | bool | None = None,
        return_dict: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits ``[B, T, vocab_size]`` for ``input_ids`` ``[B, T]`` (``[B, T, pad_token_id + 1]`` where the pad
        id lies past the vocabulary: its column is ``-inf``); with ``labels`` (HF convention: the inputs,
        shifted inside, -100 and the pad id ignored) the mean cross-entropy.

        A plain call runs the dense forward (``use_cache`` defaults to off; with an exit policy, packed
        rows under rdepth's loop controller: exited tokens cost nothing); with a ``cache`` or
        ``use_cache=True`` the tokens go through rdepth's decoder, which keeps the key/value cache,
        and the cache comes back for the next call. The cache arrives as
        ``cache`` (transformers >= 5.24) or ``past_key_values`` (before). Padded rows (contiguous ones
        in ``attention_mask``) are shifted to start at position 0 and back: their real logits are the
        unpadded row's. ``output_hidden_states`` (fixed loop counts: no exit policy) adds ``hidden_states``
        (the embedding, each single-pass layer's output and each group's hand-off in order, then the final
        norm's output, which the head reads; each ``[B, T, d]``) and ``loop_states`` (per group
        ``[K + 1, B, T, d]``: the start state and every iterate); with the cache, those of this call's
        tokens, from the dense forward of the sequence so far (the cache keeps its tokens). Attention
        weights are not returned: ``output_attentions=True`` is refused.
        """
        if input_ids is None:
            raise ValueError("rdepth models take input_ids (inputs_embeds is not supported)")
        if output_attentions:
            raise ValueError("rdepth models do not return attention weights (output_attentions): the attention is "
                             "torch's scaled_dot_product_attention, which does not form them")
        if cache is None and isinstance(past_key_values, RdepthCache):
            cache = past_key_values
        cached = cache is not None or bool(use_cache)
        offsets = padding_offsets(attention_mask, cached=cached)
        # With the cache, a new cache's decoders start each row at its first real token: nothing is shifted
        prompt_offsets = offsets if cached and cache is None else None
        offsets = None if cached else offsets
        check_length((cache.get_seq_length() if cache is not None else 0) + input_ids.shape[1],
                     self.model.config.block_size, "the sequence")
        input_ids = self.read_pads_as_end(input_ids)
        if offsets is not None:
            input_ids = shift_rows(input_ids, offsets)
        controller = self.exit_controller(exit_policy)
        counts = self.resolve_loop_counts(loop_counts) if controller is None else None
        hidden = loops = None
        if output_hidden_states and controller is not None:
            raise ValueError("output_hidden_states needs fixed loop counts: pass no exit_policy (or "
                             "exit_policy=False)")
        if cached:
            logits, cache = self._cached_logits(input_ids, prompt_offsets, cache, counts, exit_policy,
                                                controller is not None, state_seed, sequence_ids)
            if output_hidden_states:
                hidden, loops = self._cached_states(cache, attention_mask, input_ids.shape[1], counts, state_seed,
                                                    sequence_ids)
        elif output_hidden_states:
            noise = self.state_noise(input_ids.shape[0], state_seed, sequence_ids)
            logits, hidden, loops = self._states(input_ids, counts, noise)
        else:
            noise = self.state_noise(input_ids.shape[0], state_seed, sequence_ids)
            logits = self.model(input_ids, loop_counts=counts, noise=noise, controller=controller).logits
        if offsets is not None:
            logits, hidden, loops = _shift_back(offsets, logits, hidden, loops)
        loss, logits = self._loss_and_columns(logits, labels)
        if hidden is not None:
            return RdepthCausalLMOutput(loss=loss, logits=logits, hidden_states=hidden, loop_states=loops,
                                        **{CACHE_FIELD: cache})
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})

    def _loss_and_columns(self, logits: torch.Tensor, labels: torch.Tensor | None):
        """The loss against ``labels`` (HF convention: shifted inside, -100 ignored; the pad is never a target)
        and the logits widened to every id the tokenizer gives (the pad's column -inf)."""
        loss = None
        pad = self.pad_past_vocabulary()
        if labels is not None:
            if pad is not None:
                labels = labels.masked_fill(labels == pad, -100)
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        if pad is not None:
            logits = with_pad_columns(logits, pad + 1)
        return loss, logits

    def _states(self, input_ids: torch.Tensor, counts, noise) -> tuple[torch.Tensor, tuple, tuple]:
        """The dense forward's logits, with its hidden states (see :meth:`forward`) and loop iterates, read
        by the model's observer (each group's iterates) and forward hooks on the single-pass layers."""
        model = self.model
        counts = counts if counts is not None else model.config.default_eval_loops
        hidden = [model.embed(input_ids)]
        loops: dict[int, list[torch.Tensor]] = {}
        looped = model.looped_layers

        def observe(group, step, state, active):
            loops.setdefault(group, []).append(state)
            if step == counts[group]:
                hidden.append(model.hand_on(state))  # what the next stage reads

        hooks = [layer.register_forward_hook(lambda module, inputs, output: hidden.append(output))
                 for index, layer in enumerate(model.layers) if index not in looped]
        try:
            output = model(input_ids, loop_counts=counts, noise=noise, observer=observe)
        finally:
            for hook in hooks:
                hook.remove()
        hidden.append(model.final_hidden(hidden[-1]))  # what the head reads
        return output.logits, tuple(hidden), tuple(torch.stack(loops[g]) for g in sorted(loops))

    def _cached_states(self, cache: RdepthCache, attention_mask: torch.Tensor | None, length: int, counts,
                       state_seed, sequence_ids) -> tuple[tuple, tuple]:
        """The hidden states and loop iterates of the last ``length`` tokens the cache has seen: the dense
        forward of all its tokens (padded rows shifted to start at position 0 and back, as the dense
        path does), cut to those positions."""
        tokens = cache.tokens
        mask = attention_mask if attention_mask is not None and attention_mask.shape[-1] == tokens.shape[1] else None
        offsets = padding_offsets(mask, cached=False)
        if offsets is not None:
            tokens = shift_rows(tokens, offsets)
        noise = self.state_noise(tokens.shape[0], state_seed, sequence_ids)
        logits, hidden, loops = self._states(tokens, counts, noise)
        if offsets is not None:
            _, hidden, loops = _shift_back(offsets, logits, hidden, loops)
        return tuple(h[:, -length:] for h in hidden), tuple(steps[:, :, -length:] for steps in loops)

    def _cached_logits(self, input_ids: torch.Tensor, offsets: torch.Tensor | None, cache: RdepthCache | None,
                       counts, exit_policy, exits: bool, state_seed,
                       sequence_ids) -> tuple[torch.Tensor, RdepthCache]:
        """The logits of ``input_ids`` appended through the cache's decoders (a new cache when ``cache`` is
        None: rows grouped by real length, ``offsets`` their left pads; the pads' logits are zeros), and
        the cache: fixed ``counts`` or ``exit_policy``, as the cache was made with, or for this call where
        they differ (within the loop steps the cache keeps)."""
        factory = (lambda: self.exit_controller(exit_policy)) if exits else None
        budget = (tuple(counts) if counts is not None else None, repr(exit_policy) if exits else None)
        batch, length = input_ids.shape
        if cache is None:
            noise = self.state_noise(batch, state_seed, sequence_ids)
            real = torch.full((batch,), length) if offsets is None else length - offsets.cpu()
            groups = []
            for size in sorted(set(real.tolist())):
                rows = (real == size).nonzero().flatten()
                groups.append((rows, Decoder(self.model, len(rows), loop_counts=counts, controller_factory=factory,
                                             noise=StateNoise(noise.seed, [noise.sequence_ids[int(r)] for r in rows]))))
            cache = RdepthCache(groups, budget)
        pieces, same = [], budget == cache.budget
        for rows, decoder in cache.groups:
            tokens = input_ids[rows.to(input_ids.device)]
            if cache.length == 0 and offsets is not None:  # the prompt: each group from its first real token
                tokens = tokens[:, int(offsets.cpu()[rows[0]]):]
            pieces.append((rows, decoder.extend(tokens) if same else
                           decoder.extend(tokens, loop_counts=counts, controller_factory=factory)))
        logits = pieces[0][1].new_zeros(batch, length, pieces[0][1].shape[-1])
        for rows, part in pieces:
            logits[rows.to(logits.device), length - part.shape[1]:] = part
        cache.length += length
        cache.tokens = input_ids if cache.tokens is None else torch.cat([cache.tokens, input_ids], dim=1)
        return logits, cache

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, past_key_values=None,
                                      **kwargs):
        """Only the tokens the cache has not seen; the rdepth arguments passed through."""
        if cache is None and isinstance(past_key_values, RdepthCache):
            cache = past_key_values
        if not isinstance(cache, RdepthCache):
            cache = None  # a cache transformers made itself (none is ours) is not used
        if cache is not None:
            input_ids = input_ids[:, cache.get_seq_length():]
        inputs = {"input_ids": input_ids, "cache": cache, "attention_mask": attention_mask}
        for name in ("use_cache", "loop_counts", "state_seed", "sequence_ids", "exit_policy", "output_hidden_states",
                     "output_attentions"):  # (4.46 adds the output flags itself; later releases leave it to us)
            if name in kwargs:
                inputs[name] = kwargs[name]
        return inputs

    # ------------------------------------------------------------- generate
    # Settings generate() covers itself through rdepth's decoder; any other setting that asks for
    # something (beam search, top_p, processors, streamers, dict outputs, ...) goes to transformers' loop.
    _DECODER_KWARGS = frozenset({"max_new_tokens", "max_length", "do_sample", "temperature", "top_k",
                                 "eos_token_id", "pad_token_id", "use_cache", "num_beams",
                                 "num_return_sequences", "stopping_criteria"})
    # Settings that ask for nothing at these values (a generation config lists them, e.g. transformers
    # 5.0's pipeline passes every field), and settings that say nothing about decoding.
    _NEUTRAL = {"top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0,
                "length_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
                "min_length": 0, "min_new_tokens": 0, "early_stopping": False, "epsilon_cutoff": 0.0,
                "eta_cutoff": 0.0, "remove_invalid_values": False, "output_scores": False, "output_logits": False,
                "return_dict_in_generate": False, "output_attentions": False, "output_hidden_states": False,
                "num_beam_groups": 1, "diversity_penalty": 0.0, "renormalize_logits": False}
    _SILENT = frozenset({"transformers_version", "_from_model_config", "bos_token_id", "num_assistant_tokens",
                         "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind",
                         "target_lookbehind", "is_assistant", "decoder_start_token_id", "forced_bos_token_id",
                         "forced_eos_token_id", "cache_implementation", "return_legacy_cache", "disable_compile",
                         "generation_kwargs", "compile_config"})

    def _asks_for_more(self, options: dict) -> bool:
        """Whether ``options`` ask for anything rdepth's decoder does not do."""
        for name, value in options.items():
            if name in self._DECODER_KWARGS or name in self._SILENT or value is None:
                continue
            if name not in self._NEUTRAL or value != self._NEUTRAL[name]:
                return True
        return (int(options.get("num_beams") or 1) != 1 or int(options.get("num_return_sequences") or 1) != 1
                or options.get("use_cache", True) is False)

    @torch.no_grad()
    def generate(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                 loop_counts: Sequence[int] | int | str | None = None, state_seed: int | None = None,
                 sequence_ids: Sequence[int] | None = None, exit_policy: dict | bool | None = None, **kwargs):
        """Greedy (``do_sample=False``) or sampled (``temperature``, ``top_k``) continuation of
        ``input_ids`` ``[B, T]`` through rdepth's decoder; ``max_new_tokens`` (or ``max_length``) and
        ``eos_token_id`` as in transformers (finished rows continue with ``pad_token_id``). The
        rdepth arguments as :meth:`forward`'s. Other generation options go to transformers' loop."""
        passed = kwargs.pop("generation_config", None)  # transformers' pipeline passes its own
        settings = passed.to_diff_dict() if passed is not None else {}
        base = self.generation_config.to_diff_dict() if self.generation_config is not None else {}
        options = {**base, **settings, **kwargs}
        simple = input_ids is not None and not self._asks_for_more(options)
        if int(options.get("num_beams") or 1) != 1 and options.get("use_cache", True) is not False:
            raise ValueError("rdepth's key/value cache does not reorder rows for beam search: pass use_cache=False "
                             "with num_beams > 1 (the uncached forward runs transformers' beam search)")
        if not simple:
            if input_ids is not None:
                check_length(input_ids.shape[1] + _new_token_count(options, input_ids.shape[1]),
                             self.model.config.block_size, "prompt + max_new_tokens")
            if passed is not None:
                kwargs["generation_config"] = passed
            return super().generate(input_ids, attention_mask=attention_mask, loop_counts=loop_counts,
                                    state_seed=state_seed, sequence_ids=sequence_ids, exit_policy=exit_policy,
                                    **kwargs)
        return self._decode(input_ids, attention_mask, _new_token_count(options, input_ids.shape[1]), options,
                            loop_counts, state_seed, sequence_ids, exit_policy)

    def _decode(self, input_ids, attention_mask, new: int, options: dict, loop_counts, state_seed, sequence_ids,
                exit_policy) -> torch.Tensor:
        """:meth:`generate` through rdepth's decoder: rows of one real (unpadded) length decode together."""
        batch, length = input_ids.shape
        pad = self.pad_past_vocabulary()
        if attention_mask is None and pad is not None and bool((input_ids == pad).any()):
            attention_mask = (input_ids != pad).long()  # the pads mark themselves, as in transformers' loop
        offsets = padding_offsets(attention_mask, cached=False)
        if offsets is not None and bool((attention_mask.bool()[:, -1] == 0).any()):
            raise ValueError("rdepth generate() takes left-padded prompts (tokenizer.padding_side = 'left'): "
                             "a row's last token must be real")
        real = torch.full((batch,), length) if offsets is None else length - offsets.cpu()
        check_length(int(real.max()) + new, self.model.config.block_size, "prompt + max_new_tokens")
        controller = self.exit_controller(exit_policy)
        factory = None if controller is None else (lambda: self.exit_controller(exit_policy))
        counts = None if factory is not None else self.resolve_loop_counts(loop_counts)
        if counts is None and factory is None:
            counts = self.model.config.default_eval_loops
        noise = self.state_noise(batch, state_seed, sequence_ids)
        sample = bool(options.get("do_sample"))
        temperature = float(options.get("temperature") or 1.0) if sample else 0.0
        top_k = options.get("top_k") if sample else None
        out = torch.empty(batch, length + new, dtype=input_ids.dtype, device=input_ids.device)
        out[:, :length] = input_ids
        # Rows of one real length decode together, from their real tokens (left padding stripped): each
        # row's tokens are its unpadded generation's (learned positions start at its first real token).
        for size in sorted(set(real.tolist())):
            rows = (real == size).nonzero().flatten()
            decoder = Decoder(self.model, len(rows), loop_counts=counts, controller_factory=factory,
                              noise=StateNoise(noise.seed, [noise.sequence_ids[int(r)] for r in rows]))
            prompt = input_ids[rows.to(input_ids.device), length - size:]
            tokens = decoder.generate(prompt, new, temperature=temperature, top_k=top_k or None)
            out[rows.to(out.device), length:] = tokens[:, size:].to(out.device)
        return _finish_rows(out, length, options.get("eos_token_id"), options.get("pad_token_id"),
                            options.get("stopping_criteria"))


def _checkpointed(layer: torch.nn.Module, checkpoint_function):
    """``layer``'s forward, run under ``checkpoint_function`` where it records gradients without a cache
    (the dense forward in training): its activations are recomputed in the backward."""
    forward = type(layer).forward.__get__(layer)

    def run(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        attn = args[0] if args else kwargs.get("attn")
        if attn is None and torch.is_grad_enabled() and layer.training:
            return checkpoint_function(forward, x, *args, **kwargs)
        return forward(x, *args, **kwargs)

    return run


def _shift_back(offsets: torch.Tensor, logits: torch.Tensor, hidden, loops):
    """Padded rows' outputs moved back to their padded places (:func:`shift_rows` by ``-offsets``): the
    logits, and the hidden states and loop iterates where asked for."""
    logits = shift_rows(logits, -offsets)
    hidden = None if hidden is None else tuple(shift_rows(h, -offsets) for h in hidden)
    loops = None if loops is None else tuple(torch.stack([shift_rows(s, -offsets) for s in steps]) for steps in loops)
    return logits, hidden, loops


def _new_token_count(options: dict, prompt_length: int) -> int:
    """Tokens to generate: ``max_new_tokens``, else ``max_length`` (transformers' default 20) less the prompt."""
    new = options.get("max_new_tokens")
    if new is None:
        new = int(options.get("max_length") or 20) - prompt_length
    return max(int(new), 0)


def _finish_rows(tokens: torch.Tensor, prompt: int, eos, pad, criteria=None) -> torch.Tensor:
    """transformers' stopping on decoded tokens, token by token as its loop does: a row is done after an end
    token (``eos``: an id or a list) or when ``criteria`` (a ``stopping_criteria`` list, called on the
    sequences so far with ``scores`` None, in order, so stateful criteria such as lm-eval's stop strings
    work) says so; with ``eos`` set, a done row's later tokens become ``pad`` (default: the first end
    token); the batch ends at the first token after which every row is done. Greedy and sampled tokens do
    not depend on later ones, so this equals stopping while decoding."""
    ends = None if eos is None else torch.tensor([eos] if isinstance(eos, int) else list(eos), device=tokens.device)
    if ends is None and not criteria:
        return tokens
    fill = None if ends is None else int(pad if pad is not None else ends[0])
    tokens = tokens.clone()
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    for end in range(prompt + 1, tokens.shape[1] + 1):
        column = tokens[:, end - 1]
        if fill is not None:
            column.masked_fill_(done, fill)
            done = done | torch.isin(column, ends)
        if criteria:
            said = torch.as_tensor(criteria(tokens[:, :end], None), device=tokens.device).bool()
            done = done | (said.expand_as(done) if said.dim() == 0 else said)
        if bool(done.all()):
            return tokens[:, :end]
    return tokens
