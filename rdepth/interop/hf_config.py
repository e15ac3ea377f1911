"""The Hugging Face config of an exported rdepth model (shipped as ``configuration_rdepth.py``).

Its model fields mirror :class:`rdepth.config.ModelConfig` one to one (a test keeps
them equal), so ``config.json`` reads like an rdepth checkpoint's config. Three fields
are the exported model's own:

- ``loop_counts``: loop steps per group when ``forward``/``generate`` get none
  (``None``: the model's ``eval_loops``, else ``round(mean_loops)`` for every group);
- ``state_seed``: seed of the random initial loop state. The state of the token at
  position t is drawn from a generator keyed by (seed, sequence id, group), sequence
  id 0 unless ``sequence_ids`` is passed, so outputs are deterministic and do not
  depend on the batch. ``init_state_scale = 0`` gives a zero state instead;
- ``exit_policy``: per-token early exit, e.g. ``{"name": "acceleration", "tau":
  0.001, "k_max": 12}`` (``None``: fixed loop counts).

This file must import nothing from rdepth: it is copied into exported folders.
"""

from __future__ import annotations

from transformers import PreTrainedConfig


class RdepthConfig(PreTrainedConfig):
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
    # the exported model's own
    loop_counts: list[int] | None = None
    state_seed: int = 0
    exit_policy: dict | None = None
    # the head reads the token embedding directly: there is no separate output matrix to tie
    tie_word_embeddings: bool = False
    use_cache: bool = True
