"""The Hugging Face wrapper around :class:`rdepth.model.RecurrentLM` (shipped as ``modeling_rdepth.py``).

:func:`rdepth.interop.source.modeling_source` bundles this file with the rdepth
modules it imports into one self-contained file, so an exported folder loads with
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` without rdepth
installed. The wrapper adds no computation: ``forward`` calls ``RecurrentLM``,
dense for a plain call, packed rows with rdepth's key/value cache when called with
one; ``generate`` runs rdepth's one decoder (:class:`rdepth.model.decoder.Decoder`,
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

Padding: right padding only (each row's mask is ones then zeros; causal attention
keeps the real tokens exact); learned positions make left padding change the
answer, so it is refused. Beam search is not supported (the cache is not reordered).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from rdepth.config import ModelConfig, parse_loop_counts
from rdepth.exits.controller import PolicyController
from rdepth.interop.hf_config import RdepthConfig
from rdepth.model.decoder import Decoder
from rdepth.model.kv import KVStore
from rdepth.model.noise import StateNoise
from rdepth.model.recurrent import RecurrentLM

def model_config_of(config: RdepthConfig) -> ModelConfig:
    """The rdepth model config held in a Hugging Face config (the fields of ModelConfig)."""
    values = {field.name: getattr(config, field.name) for field in dataclasses.fields(ModelConfig)}
    if values["eval_loops"] is not None:
        values["eval_loops"] = tuple(values["eval_loops"])
    return ModelConfig(**values)


class RdepthCache:
    """rdepth's key/value store for one ``generate`` call, with the initial-state noise it uses."""

    is_compileable = False
    is_linear = (False,)
    is_croppable = False

    def __init__(self, store: KVStore, noise: StateNoise | None):
        self.store = store
        self.noise = noise

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.store.length


def _check_padding(attention_mask: torch.Tensor | None, cached: bool) -> None:
    """Right padding only (ones then zeros per row); no padding at all with a cache."""
    if attention_mask is None or attention_mask.ndim != 2:
        return
    mask = attention_mask.bool()
    if bool(mask.all()):
        return
    if cached:
        raise ValueError("rdepth models generate without padding: pass one prompt, or prompts of equal length")
    ones_then_zeros = (mask.long().cumprod(dim=1) == mask.long()).all()
    if not bool(ones_then_zeros):
        raise ValueError("rdepth models take right-padded batches only (learned positions make left padding "
                         "change the outputs); pad on the right")


class RdepthForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = RdepthConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["SandwichBlock", "GPT2Block"]

    def __init__(self, config: RdepthConfig):
        super().__init__(config)
        self.model = RecurrentLM(model_config_of(config))
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        if isinstance(module, RecurrentLM):
            module.reset_parameters()  # rdepth's own initialisation (weights are then loaded over it)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is rdepth's own (one key/value per loop step)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.wte

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.wte = value

    def get_output_embeddings(self) -> None:
        return None  # the head is the token embedding itself (RecurrentLM.readout)

    # -------------------------------------------------------------- settings
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
        return PolicyController.from_name(name, tau=options.pop("tau", None), k_max=k_max,
                                          decode=self.model.readout, **options)

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
        use_cache: bool | None = None,
        loop_counts: Sequence[int] | int | str | None = None,
        state_seed: int | None = None,
        sequence_ids: Sequence[int] | None = None,
        exit_policy: dict | bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits ``[B, T, vocab_size]`` for ``input_ids`` ``[B, T]``; with ``labels`` (HF
        convention: the inputs, shifted inside, -100 ignored) the mean cross-entropy.

        A plain call runs the dense forward (``use_cache`` defaults to off); with a
        ``cache`` or ``use_cache=True`` it runs packed rows against rdepth's key/value
        cache and returns the cache for the next call; with an exit policy, packed
        rows under rdepth's loop controller (exited tokens cost nothing).
        """
        if input_ids is None:
            raise ValueError("rdepth models take input_ids (inputs_embeds is not supported)")
        _check_padding(attention_mask, cached=cache is not None or bool(use_cache))
        controller = self.exit_controller(exit_policy)
        counts = self.resolve_loop_counts(loop_counts) if controller is None else None
        if cache is None and use_cache:
            cache = RdepthCache(self.model.new_cache(input_ids.shape[0]),
                                self.state_noise(input_ids.shape[0], state_seed, sequence_ids))
        if cache is not None:
            output = self.model(input_ids, loop_counts=counts, generator=cache.noise, cache=cache.store,
                                controller=controller)
        else:
            noise = self.state_noise(input_ids.shape[0], state_seed, sequence_ids)
            output = self.model(input_ids, loop_counts=counts, generator=noise, controller=controller)
        logits = output.logits
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, **kwargs):
        """Only the tokens the cache has not seen; the rdepth arguments passed through."""
        if cache is not None:
            input_ids = input_ids[:, cache.get_seq_length():]
        inputs = {"input_ids": input_ids, "cache": cache, "attention_mask": attention_mask}
        for name in ("use_cache", "loop_counts", "state_seed", "sequence_ids", "exit_policy"):
            if name in kwargs:
                inputs[name] = kwargs[name]
        return inputs

    # ------------------------------------------------------------- generate
    # Keyword arguments generate() takes itself; any other (beam search, top_p, processors, streamers,
    # dict outputs, ...) goes to transformers' own loop.
    _DECODER_KWARGS = frozenset({"max_new_tokens", "max_length", "do_sample", "temperature", "top_k",
                                 "eos_token_id", "pad_token_id", "use_cache", "num_beams",
                                 "num_return_sequences"})

    @torch.no_grad()
    def generate(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                 loop_counts: Sequence[int] | int | str | None = None, state_seed: int | None = None,
                 sequence_ids: Sequence[int] | None = None, exit_policy: dict | bool | None = None, **kwargs):
        """Greedy (``do_sample=False``) or sampled (``temperature``, ``top_k``) continuation of
        ``input_ids`` ``[B, T]`` through rdepth's decoder; ``max_new_tokens`` (or ``max_length``) and
        ``eos_token_id`` as in transformers (finished rows continue with ``pad_token_id``). The
        rdepth arguments as :meth:`forward`'s. Other generation options go to transformers' loop."""
        options = {**self.generation_config.to_diff_dict(), **kwargs} if self.generation_config else dict(kwargs)
        simple = (input_ids is not None and set(kwargs) <= self._DECODER_KWARGS
                  and int(options.get("num_beams") or 1) == 1 and int(options.get("num_return_sequences") or 1) == 1
                  and options.get("use_cache", True) is not False and not options.get("top_p"))
        if not simple:
            return super().generate(input_ids, attention_mask=attention_mask, loop_counts=loop_counts,
                                    state_seed=state_seed, sequence_ids=sequence_ids, exit_policy=exit_policy,
                                    **kwargs)
        _check_padding(attention_mask, cached=True)
        batch, length = input_ids.shape
        new = options.get("max_new_tokens")
        if new is None:
            new = int(options.get("max_length") or 20) - length
        controller = self.exit_controller(exit_policy)
        factory = None if controller is None else (lambda: self.exit_controller(exit_policy))
        counts = None if factory is not None else self.resolve_loop_counts(loop_counts)
        if counts is None and factory is None:
            counts = self.model.config.default_eval_loops
        decoder = Decoder(self.model, batch, loop_counts=counts, controller_factory=factory,
                          noise=self.state_noise(batch, state_seed, sequence_ids))
        sample = bool(options.get("do_sample"))
        temperature = float(options.get("temperature") or 1.0) if sample else 0.0
        top_k = options.get("top_k") if sample else None
        tokens = decoder.generate(input_ids, max(int(new), 0), temperature=temperature, top_k=top_k or None)
        return _stop_at_eos(tokens, length, options.get("eos_token_id"), options.get("pad_token_id"))


def _stop_at_eos(tokens: torch.Tensor, prompt: int, eos, pad) -> torch.Tensor:
    """transformers' stopping: after a row's first end token (``eos``: an id or a list) its later tokens
    become ``pad`` (default: the first end token), and the batch ends where every row has ended."""
    if eos is None:
        return tokens
    ends = torch.tensor([eos] if isinstance(eos, int) else list(eos), device=tokens.device)
    generated = tokens[:, prompt:]
    is_end = torch.isin(generated, ends)
    after = (is_end.long().cumsum(dim=1) - is_end.long()) > 0  # strictly after the first end token
    generated = generated.masked_fill(after, int(pad if pad is not None else ends[0]))
    finished = is_end.long().cumsum(dim=1) > 0
    done_at = finished.all(dim=0).nonzero()
    keep = int(done_at[0]) + 1 if done_at.numel() else generated.shape[1]
    return torch.cat([tokens[:, :prompt], generated[:, :keep]], dim=1)
