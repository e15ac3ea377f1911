"""Ouro / LoopLM folders (``model_type: ouro``, ByteDance's Ouro-1.4B and Ouro-2.6B) as rdepth models.

Ouro loops every layer ``total_ut_steps`` times (4 in the released models) and ends each step with its
final norm: ``s_0 = embed(tokens)``, ``s_k = norm(layers(s_{k-1}))``, logits ``lm_head(s_K)``. In rdepth
that is one recurrence group over every layer with four options (``ModelConfig``): ``block="peri"``
(RMSNorm before each sub-layer and on its output, before the residual sum), ``loop_state="looplm"``
(no adapter, the loop starts from the embedding, each step ends with ``norm_f``, the head reads the
state as it is), ``tie_head`` false (its own ``lm_head``) and ``exit_gate`` (its ``early_exit_gate``, a
``Linear(d, 1)`` read after every step, the ``ouro`` exit rule's signal), besides rotary positions over
the two halves of each head (``rope_pairs="half"``: channel ``i`` with ``i + hs/2``, rotate-half), a
gated SiLU MLP (``mlp="swiglu"``) and the unscaled token embedding.

=========================================  ============================  ==============================
Ouro (``model.`` prefix)                    rdepth                        note
=========================================  ============================  ==============================
``embed_tokens``                            ``wte``                       padded to 64 rows
``layers.i.self_attn.q_proj/k_proj/v_proj`` ``layers.i.attn.qkv``         rows: queries, keys, values
``layers.i.self_attn.o_proj``               ``layers.i.attn.proj``
``layers.i.mlp.gate_proj`` / ``up_proj``    ``layers.i.mlp.fc``           rows: gate, then up
``layers.i.mlp.down_proj``                  ``layers.i.mlp.proj``
``input_layernorm`` / ``input_layernorm_2`` ``norm_1`` / ``norm_2``       around attention
``post_attention_layernorm`` (``_2``)       ``norm_3`` / ``norm_4``       around the MLP
``norm``                                    ``norm_f``                    after every loop step
``early_exit_gate`` (weight, bias)          ``exit_gate``                 ``[1, d]`` and ``[1]``
``lm_head`` (top level)                     ``head``                      padded to 64 rows
=========================================  ============================  ==============================

Loop counts: ``total_ut_steps`` becomes the eval count (``eval_loops``) and ``mean_loops``. Settings
rdepth does not compute (grouped-query attention, a sliding window, scaled rotary positions, another
activation, a head width other than d / heads) are refused with the field named.
:func:`write_ouro_folder` writes a small random Ouro-layout folder from a seed (tests, golden files),
without ``transformers``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rdepth.config import MAX_BLOCK_SIZE
from rdepth.errors import RdepthError
from rdepth.interop.hf_weights import INDEX_FILE, read_hub_weights
from rdepth.model import RecurrentLM

MODEL_TYPE = "ouro"
PREFIX = "model."
# Ouro's per-layer tensors that map one to one: name -> rdepth's
LAYER_NAMES = {
    "self_attn.o_proj.weight": "attn.proj.weight", "mlp.down_proj.weight": "mlp.proj.weight",
    "input_layernorm.weight": "norm_1.weight", "input_layernorm_2.weight": "norm_2.weight",
    "post_attention_layernorm.weight": "norm_3.weight", "post_attention_layernorm_2.weight": "norm_4.weight",
}
# Fields whose value rdepth computes only as the released models have it: field -> allowed values
FIXED = {
    "hidden_act": ("silu",), "use_sliding_window": (False,), "rope_scaling": (None,),
    "attention_bias": (False,), "mlp_bias": (False,), "attention_dropout": (0, 0.0),
}
# What the reference's OuroConfig takes when a field is absent
DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "total_ut_steps": 4, "tie_word_embeddings": False,
            "max_position_embeddings": 32768}


def ouro_model_config(folder: Path, hf: dict) -> dict:
    """rdepth ModelConfig fields for the Ouro ``config.json`` ``hf``; one error naming every field rdepth
    cannot honour."""
    def need(key: str, minimum: int = 1) -> int:
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise RdepthError(f"{folder}: Ouro config.json has no integer {key!r} >= {minimum} (got {value!r})")
        return value

    width, heads, layers = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    refusals = [f"{key} {hf[key]!r} (rdepth computes {' or '.join(map(repr, allowed))})"
                for key, allowed in FIXED.items() if key in hf and hf[key] not in allowed]
    if hf.get("num_key_value_heads", heads) != heads:
        refusals.append(f"num_key_value_heads {hf['num_key_value_heads']!r} (grouped-query attention; rdepth's "
                        f"attention has as many key/value heads as query heads, {heads})")
    if width % heads:
        refusals.append(f"hidden_size {width} (not a multiple of num_attention_heads {heads})")
    elif hf.get("head_dim", width // heads) != width // heads:
        refusals.append(f"head_dim {hf['head_dim']!r} (rdepth's heads are hidden_size / heads = {width // heads} wide)")
    types = hf.get("layer_types")
    if types is not None and (not isinstance(types, list) or any(kind != "full_attention" for kind in types)):
        refusals.append(f"layer_types {types!r} (rdepth's attention is full causal attention in every layer)")
    positions = hf.get("max_position_embeddings", DEFAULTS["max_position_embeddings"])
    if not isinstance(positions, int) or isinstance(positions, bool) or not 1 <= positions <= MAX_BLOCK_SIZE:
        refusals.append(f"max_position_embeddings {positions!r} (rdepth's context is 1..{MAX_BLOCK_SIZE} tokens)")
    if refusals:
        raise RdepthError(f"cannot import {folder} ({MODEL_TYPE}): rdepth's model does not compute "
                          + "; ".join(refusals))
    steps = hf.get("total_ut_steps", DEFAULTS["total_ut_steps"])
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise RdepthError(f"{folder}: Ouro config.json has total_ut_steps {steps!r}; rdepth needs an integer >= 1")
    return dict(
        block="peri", loop_state="looplm", positions="rotary", rope_pairs="half", mlp="swiglu", tie_head=_tied(hf),
        exit_gate=True, n_layer=layers, groups=f"0-{layers - 1}", n_head=heads, d_model=width,
        block_size=positions, vocab_size=need("vocab_size"), mlp_hidden=need("intermediate_size"),
        rope_base=float(hf.get("rope_theta", DEFAULTS["rope_theta"])),
        norm_eps=float(hf.get("rms_norm_eps", DEFAULTS["rms_norm_eps"])), init_state_scale=0.0,
        mean_loops=float(steps), loop_sigma=0.5, backprop_depth=steps, eval_loops=(steps,),
    )


def _tied(hf: dict) -> bool:
    return bool(hf.get("tie_word_embeddings", DEFAULTS["tie_word_embeddings"]))


def ouro_state_dict(folder: Path, weights: dict[str, torch.Tensor], model: RecurrentLM) -> dict[str, torch.Tensor]:
    """rdepth names and layouts for Ouro's ``weights``, every tensor used once and checked against ``model``.
    Each tensor leaves ``weights`` as it is taken (emptied on success: the folder's copy is not held beside
    the float32 one, which matters at 1.4B parameters)."""
    config = model.config
    expected = model.state_dict()
    mapped: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise RdepthError(f"{folder}: Ouro weight {name!r} is missing")
        used.add(name)
        return weights.pop(name).float()

    def shaped(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = take(name)
        if tuple(tensor.shape) != shape:
            raise RdepthError(f"{folder}: Ouro weight {name!r} has shape {tuple(tensor.shape)}, its config.json "
                              f"implies {shape}")
        return tensor

    def padded(name: str) -> torch.Tensor:
        rows = torch.zeros(config.padded_vocab_size, config.d_model)
        rows[: config.vocab_size] = shaped(name, (config.vocab_size, config.d_model))  # rows past it never read
        return rows

    d, hidden = config.d_model, config.hidden_width
    embedding = weights.get(PREFIX + "embed_tokens.weight") if config.tie_head else None  # the tie check reads it
    mapped["wte.weight"] = padded(PREFIX + "embed_tokens.weight")
    for index in range(config.n_layer):
        source = f"{PREFIX}layers.{index}."
        q, k, v = (shaped(f"{source}self_attn.{name}_proj.weight", (d, d)) for name in "qkv")
        mapped[f"layers.{index}.attn.qkv.weight"] = torch.cat([q, k, v])
        gate = shaped(source + "mlp.gate_proj.weight", (hidden, d))
        mapped[f"layers.{index}.mlp.fc.weight"] = torch.cat([gate, shaped(source + "mlp.up_proj.weight", (hidden, d))])
        for ouro_name, name in LAYER_NAMES.items():
            mapped[f"layers.{index}.{name}"] = shaped(source + ouro_name, tuple(expected[f"layers.{index}.{name}"].shape))
    mapped["norm_f.weight"] = shaped(PREFIX + "norm.weight", (d,))
    mapped["exit_gate.weight"] = shaped(PREFIX + "early_exit_gate.weight", (1, d))
    mapped["exit_gate.bias"] = shaped(PREFIX + "early_exit_gate.bias", (1,))
    if config.tie_head:
        if "lm_head.weight" in weights and not torch.equal(take("lm_head.weight"), embedding.float()):
            raise RdepthError(f"cannot import {folder} ({MODEL_TYPE}): tie_word_embeddings is true but its lm_head "
                              "differs from embed_tokens")
    else:
        mapped["head.weight"] = padded("lm_head.weight")
    unexpected = sorted(weights)  # what was not taken
    if unexpected:
        raise RdepthError(f"{folder}: unexpected Ouro weights {unexpected[:3]}")
    if set(mapped) != set(expected):  # the config and the layout above disagree: a bug, named
        raise RdepthError(f"{folder}: the Ouro layout does not fill the model: {sorted(set(expected) ^ set(mapped))[:3]}")
    return mapped


def ouro_model(folder: str | Path, tokenizer: str | None = None) -> RecurrentLM:
    """The rdepth model (float32, eval mode) of the Ouro folder ``folder`` (``tokenizer``: the spec its
    config records; default ``bpe:<vocab_size>``)."""
    from rdepth.interop.hf_raven import hub_model
    from rdepth.io import read_json_object

    folder = Path(folder)
    values = ouro_model_config(folder, read_json_object(folder / "config.json", "Hugging Face config"))
    return hub_model(folder, MODEL_TYPE, values, tokenizer,
                     lambda model: ouro_state_dict(folder, read_hub_weights(folder), model))


def import_ouro(folder: Path, hf_config: dict) -> tuple[RecurrentLM, dict]:
    """An Ouro folder: the rdepth model (float32, eval mode) and the tokenizer files to save."""
    from rdepth.interop.hf_raven import raven_tokenizer_files  # the folder's tokenizer.json as a BPE

    if hf_config.get("model_type") != MODEL_TYPE:
        raise RdepthError(f"{folder}: model_type {hf_config.get('model_type')!r} is not {MODEL_TYPE!r}")
    spec, tokenizer_files = raven_tokenizer_files(folder, ouro_model_config(folder, hf_config)["vocab_size"])
    return ouro_model(folder, spec), tokenizer_files


# The published configs' fields (ByteDance/Ouro-1.4B and ByteDance/Ouro-2.6B config.json, as data): the two
# differ in their layer count only. Their parameter counts, as the reference's OuroForCausalLM counts them
# (scripts/ouro_parity.py; tests/golden/ouro_tiny.json): 1,434,652,673 and 2,667,974,657.
OURO_1_4B = dict(
    model_type="ouro", architectures=["OuroForCausalLM"], vocab_size=49152, hidden_size=2048,
    intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
    hidden_act="silu", max_position_embeddings=65536, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
    tie_word_embeddings=False, use_sliding_window=False, attention_dropout=0.0, total_ut_steps=4,
    early_exit_threshold=1.0, torch_dtype="bfloat16",
)
OURO_2_6B = {**OURO_1_4B, "num_hidden_layers": 48}


# ------------------------------------------------------------------ a tiny Ouro-layout folder
TINY_OURO = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=48,
                 num_hidden_layers=2, max_position_embeddings=64, vocab_size=96, total_ut_steps=4,
                 rope_theta=10000.0, rms_norm_eps=1e-6)


def ouro_config_json(**overrides) -> dict:
    """An Ouro ``config.json`` of :data:`TINY_OURO` (fields as the reference's OuroConfig names them)."""
    fields = {**TINY_OURO, **overrides}
    return {"model_type": MODEL_TYPE, "architectures": ["OuroForCausalLM"], "hidden_act": "silu",
            "tie_word_embeddings": False, "use_sliding_window": False, "rope_scaling": None,
            "attention_dropout": 0.0, "early_exit_threshold": 1.0, "torch_dtype": "float32",
            "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, **fields}


def ouro_weight_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of an Ouro checkpoint with its shape, in the reference's names and order."""
    d, hidden, vocab = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    kv = hf.get("num_key_value_heads", hf["num_attention_heads"]) * (d // hf["num_attention_heads"])
    shapes = {PREFIX + "embed_tokens.weight": (vocab, d)}
    for i in range(hf["num_hidden_layers"]):
        source = f"{PREFIX}layers.{i}."
        shapes.update({source + "self_attn.q_proj.weight": (d, d), source + "self_attn.k_proj.weight": (kv, d),
                       source + "self_attn.v_proj.weight": (kv, d), source + "self_attn.o_proj.weight": (d, d),
                       source + "mlp.gate_proj.weight": (hidden, d), source + "mlp.up_proj.weight": (hidden, d),
                       source + "mlp.down_proj.weight": (d, hidden)})
        for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            shapes[f"{source}{norm}.weight"] = (d,)
    shapes.update({PREFIX + "norm.weight": (d,), PREFIX + "early_exit_gate.weight": (1, d),
                   PREFIX + "early_exit_gate.bias": (1,)})
    if not _tied(hf):
        shapes["lm_head.weight"] = (vocab, d)
    return shapes


def write_ouro_folder(folder: str | Path, seed: int = 0, tokenizer_json: str | None = None, shards: int = 1,
                      gate_scale: float = 1.0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A random Ouro-layout folder: ``config.json`` (:func:`ouro_config_json` with ``overrides``) and its
    weights, every tensor drawn from a generator seeded with ``seed`` in the order of
    :func:`ouro_weight_shapes` (matrices ~ N(0, 1/fan-in), norm gains 1 + N(0, 0.2^2), the gate's weight
    times ``gate_scale`` and its bias N(0, 1): all of them matter), stored as ``dtype`` (the hub's are
    bfloat16), in ``shards`` files with an index when more than one; a ``tokenizer.json`` when given."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf = ouro_config_json(**overrides)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in ouro_weight_shapes(hf).items():
        noise = torch.randn(shape, generator=generator, dtype=torch.float64)
        if name.endswith("early_exit_gate.bias"):
            tensor = noise
        elif len(shape) == 1:
            tensor = 1.0 + 0.2 * noise
        else:
            tensor = noise / shape[-1] ** 0.5 * (gate_scale if "early_exit_gate" in name else 1.0)
        weights[name] = tensor.float().to(dtype).contiguous()  # through float32: float32 files as before
    if shards <= 1:
        save_file(weights, str(folder / "model.safetensors"))
    else:
        names = list(weights)
        parts = [names[i::shards] for i in range(shards)]
        weight_map = {}
        for number, part in enumerate(parts, 1):
            file = f"model-{number:05d}-of-{shards:05d}.safetensors"
            save_file({name: weights[name] for name in part}, str(folder / file))
            weight_map.update({name: file for name in part})
        total = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                    indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if tokenizer_json is not None:
        (folder / "tokenizer.json").write_text(tokenizer_json)
    return folder
