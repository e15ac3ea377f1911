"""The Hugging Face config of an exported rdepth model (shipped as ``configuration_rdepth.py``).

Its model fields mirror :class:`rdepth.config.ModelConfig` one to one (a test keeps
them equal), so ``config.json`` reads like an rdepth checkpoint's config, but for one thing:
``vocab_size`` is transformers' vocabulary, the logits' width, which counts the export's own pad
token (``extra_pad_token``). Four fields are the exported model's own:

- ``loop_counts``: loop steps per group when ``forward``/``generate`` get none
  (``None``: the model's ``eval_loops``, else ``round(mean_loops)`` for every group);
- ``state_seed``: seed of the random initial loop state. The state of the token at
  position t is drawn from a generator keyed by (seed, sequence id, group), sequence
  id 0 unless ``sequence_ids`` is passed, so outputs are deterministic and do not
  depend on the batch. ``init_state_scale = 0`` gives a zero state instead;
- ``exit_policy``: per-token early exit, e.g. ``{"name": "acceleration", "tau":
  0.001, "k_max": 12}`` (``None``: fixed loop counts);
- ``extra_pad_token``: ``vocab_size`` counts the pad token (``pad_token_id = vocab_size - 1``), which
  the rdepth model does not hold: its vocabulary is ``vocab_size - 1`` tokens, the pad reads as the end
  token and its logit is ``-inf`` (:mod:`rdepth.interop.hf_model`). transformers checks that special
  ids lie below ``vocab_size``, and its processors index the logits by input ids.

Supported ``transformers``: 4.46 through the newest tested release (:data:`TESTED_RANGE`).
What differs between them is feature-detected here and in the wrapper: the config base class
(``PreTrainedConfig`` from 5.0, ``PretrainedConfig`` before; a dataclass in 5.24 (not in 5.0; detected), whose fields
are the class annotations, a plain class before, which needs the ``__init__`` below) and the
cache's name (``cache`` from 5.24, ``past_key_values`` before; see :mod:`rdepth.interop.hf_model`).
An older ``transformers`` fails at import with a one-line message naming the range.

This file must import nothing from rdepth: it is copied into exported folders.
"""

from __future__ import annotations

import copy
import dataclasses

import transformers

MIN_TRANSFORMERS = (4, 46)  # the oldest release the export runs on (tested)
TESTED_RANGE = "transformers >= 4.46 (tested on 4.46.3, 4.57.6, 5.0.0 and 5.24.0)"


def _version(text: str) -> tuple[int, int]:
    numbers = []
    for part in text.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers)


if _version(transformers.__version__) < MIN_TRANSFORMERS:
    raise ImportError(f"this rdepth export needs {TESTED_RANGE}; found transformers {transformers.__version__}")

try:  # 5.0 and later
    from transformers import PreTrainedConfig as _BaseConfig
except ImportError:  # 4.x
    from transformers import PretrainedConfig as _BaseConfig

# Fields the base class's own __init__ takes (where the base is not a dataclass, it sets them itself, overwriting ours).
_BASE_FIELDS = ("tie_word_embeddings",)


class RdepthConfig(_BaseConfig):
    model_type = "rdepth"
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "max_position_embeddings": "block_size",
    }

    # rdepth.config.ModelConfig, field for field
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    block_size: int = 512
    vocab_size: int = 50257
    groups: str = "4|5-6|7"
    mean_loops: float = 12.0
    loop_sigma: float = 0.5
    backprop_depth: int = 8
    init_state_scale: float = 1.0
    eval_loops: list[int] | None = None
    mlp_ratio: int = 4
    norm_eps: float = 1e-6
    block: str = "sandwich"
    tokenizer: str = "gpt2"
    loop_state: str = "sandwich"
    positions: str = "learned"
    rope_base: float = 10000.0
    rope_pairs: str = "adjacent"
    mlp: str = "plain"
    mlp_hidden: int | None = None
    qk_bias: bool = False
    handoff_norm: bool = False
    tie_head: bool = True
    exit_gate: bool = False
    # the exported model's own
    loop_counts: list[int] | None = None
    state_seed: int = 0
    exit_policy: dict | None = None
    extra_pad_token: bool = False
    # the head is the token embedding itself (RecurrentLM.readout): tied
    tie_word_embeddings: bool = True
    use_cache: bool = True

    if not dataclasses.is_dataclass(_BaseConfig):  # 4.x, 5.0: the fields are set here
        def __init__(self, **kwargs):
            for name in _own_fields():
                value = kwargs.pop(name, getattr(type(self), name))
                if name in _BASE_FIELDS:
                    kwargs[name] = value
                else:
                    setattr(self, name, copy.deepcopy(value))
            super().__init__(**kwargs)


def model_vocab_size(config) -> int:
    """The rdepth model's vocabulary in a config of this class: ``vocab_size`` less the export's own pad token."""
    return int(config.vocab_size) - (1 if getattr(config, "extra_pad_token", False) else 0)


def _own_fields() -> list[str]:
    """The annotated fields of :class:`RdepthConfig` (rdepth's ModelConfig and the export's own)."""
    return [name for name in RdepthConfig.__dict__.get("__annotations__", {})]
