"""Load BERT- and GPT-2-style Hugging Face checkpoint directories into a plain-PyTorch Teacher.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` (preferred) or
``pytorch_model.bin`` (read with ``torch.load(weights_only=True)``). No code from
``transformers`` runs here; the weights are mapped onto :class:`TransformerLayer`.
Architectures are chosen by ``config["model_type"]`` from :data:`ARCHITECTURES`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from rdepth.errors import RdepthError
from rdepth.io import read_json_object
from rdepth.surrogate.teachers.layers import LayerSpec, Teacher, TransformerLayer

log = logging.getLogger(__name__)

HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}
# Wrapper prefixes of task heads (BertForMaskedLM, GPT2LMHeadModel, ...) stripped from keys.
KEY_PREFIXES = ("bert.", "transformer.", "model.")


class BertEmbedding(nn.Module):
    """word + absolute position + token-type-0 embeddings, then LayerNorm. ids (B, T) -> (B, T, D)."""

    def __init__(self, vocab: int, max_positions: int, type_vocab: int, d_model: int, eps: float) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(max_positions, d_model)
        self.token_type = nn.Embedding(type_vocab, d_model)
        self.norm = nn.LayerNorm(d_model, eps=eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word(ids) + self.position(positions)[None] + self.token_type.weight[0]
        return self.norm(x)


class Gpt2Embedding(nn.Module):
    """token + absolute position embeddings. ids (B, T) -> (B, T, D)."""

    def __init__(self, vocab: int, max_positions: int, d_model: int) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(max_positions, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.word(ids) + self.position(positions)[None]


def _activation(config: dict, key: str) -> str:
    name = config.get(key, "gelu")
    if name not in HF_ACTIVATIONS:
        raise RdepthError(f"unsupported activation {name!r} in config.json (supported: {sorted(HF_ACTIVATIONS)})")
    return HF_ACTIVATIONS[name]


class _Weights:
    """A state dict that hands out tensors by name and reports a missing one as an RdepthError."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: Path) -> None:
        self.tensors = {}
        for key, value in tensors.items():
            for prefix in KEY_PREFIXES:
                if key.startswith(prefix):
                    key = key[len(prefix):]
                    break
            self.tensors[key] = value
        self.source = source

    def __call__(self, key: str) -> torch.Tensor:
        if key not in self.tensors:
            raise RdepthError(f"{self.source}: weight {key!r} is missing")
        return self.tensors[key].float()


def _copy(param: torch.Tensor, value: torch.Tensor, key: str) -> None:
    if param.shape != value.shape:
        raise RdepthError(f"weight {key!r} has shape {tuple(value.shape)}, config implies {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value)


def _build_bert(config: dict, weights: _Weights) -> Teacher:
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise RdepthError("only absolute position embeddings are supported for BERT")
    d = config["hidden_size"]
    spec = LayerSpec(d_model=d, n_heads=config["num_attention_heads"], d_ff=config["intermediate_size"],
                     norm_position="post", causal=False, activation=_activation(config, "hidden_act"),
                     norm_eps=config.get("layer_norm_eps", 1e-12))
    embedding = BertEmbedding(config["vocab_size"], config["max_position_embeddings"],
                              config.get("type_vocab_size", 2), d, spec.norm_eps)
    for param, key in ((embedding.word.weight, "embeddings.word_embeddings.weight"),
                       (embedding.position.weight, "embeddings.position_embeddings.weight"),
                       (embedding.token_type.weight, "embeddings.token_type_embeddings.weight"),
                       (embedding.norm.weight, "embeddings.LayerNorm.weight"),
                       (embedding.norm.bias, "embeddings.LayerNorm.bias")):
        _copy(param, weights(key), key)
    layers = []
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        layer = TransformerLayer(spec)
        qkv_w = torch.cat([weights(p + f"attention.self.{n}.weight") for n in ("query", "key", "value")])
        qkv_b = torch.cat([weights(p + f"attention.self.{n}.bias") for n in ("query", "key", "value")])
        _copy(layer.qkv.weight, qkv_w, p + "attention.self.*.weight")
        _copy(layer.qkv.bias, qkv_b, p + "attention.self.*.bias")
        for module, key in ((layer.attn_out, "attention.output.dense"), (layer.norm_attn, "attention.output.LayerNorm"),
                            (layer.mlp_in, "intermediate.dense"), (layer.mlp_out, "output.dense"),
                            (layer.norm_mlp, "output.LayerNorm")):
            _copy(module.weight, weights(p + key + ".weight"), p + key + ".weight")
            _copy(module.bias, weights(p + key + ".bias"), p + key + ".bias")
        layers.append(layer)
    return Teacher(embedding, layers, None, spec, name="bert")


def _build_gpt2(config: dict, weights: _Weights) -> Teacher:
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if config.get(flag):
            raise RdepthError(f"GPT-2 option {flag}=true is not supported")
    if config.get("scale_attn_weights") is False:
        raise RdepthError("GPT-2 option scale_attn_weights=false is not supported")
    d = config["n_embd"]
    spec = LayerSpec(d_model=d, n_heads=config["n_head"], d_ff=config.get("n_inner") or 4 * d,
                     norm_position="pre", causal=True, activation=_activation(config, "activation_function"),
                     norm_eps=config.get("layer_norm_epsilon", 1e-5))
    embedding = Gpt2Embedding(config["vocab_size"], config["n_positions"], d)
    _copy(embedding.word.weight, weights("wte.weight"), "wte.weight")
    _copy(embedding.position.weight, weights("wpe.weight"), "wpe.weight")
    layers = []
    for i in range(config["n_layer"]):
        p = f"h.{i}."
        layer = TransformerLayer(spec)
        # GPT-2's Conv1D stores weights as (in, out): transpose into nn.Linear's (out, in).
        for module, key in ((layer.qkv, "attn.c_attn"), (layer.attn_out, "attn.c_proj"),
                            (layer.mlp_in, "mlp.c_fc"), (layer.mlp_out, "mlp.c_proj")):
            _copy(module.weight, weights(p + key + ".weight").t(), p + key + ".weight")
            _copy(module.bias, weights(p + key + ".bias"), p + key + ".bias")
        for module, key in ((layer.norm_attn, "ln_1"), (layer.norm_mlp, "ln_2")):
            _copy(module.weight, weights(p + key + ".weight"), p + key + ".weight")
            _copy(module.bias, weights(p + key + ".bias"), p + key + ".bias")
        layers.append(layer)
    readout = nn.LayerNorm(d, eps=spec.norm_eps)
    _copy(readout.weight, weights("ln_f.weight"), "ln_f.weight")
    _copy(readout.bias, weights("ln_f.bias"), "ln_f.bias")
    return Teacher(embedding, layers, readout, spec, name="gpt2")


ARCHITECTURES: dict[str, Callable[[dict, _Weights], Teacher]] = {"bert": _build_bert, "gpt2": _build_gpt2}


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """Tensors of ``model.safetensors`` or ``pytorch_model.bin`` in ``directory``."""
    safetensors_path = directory / "model.safetensors"
    bin_path = directory / "pytorch_model.bin"
    if safetensors_path.is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(safetensors_path))
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise RdepthError(f"{safetensors_path} is not a readable safetensors file ({type(exc).__name__})") from None
    if bin_path.is_file():
        try:
            state = torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise RdepthError(f"{bin_path} could not be read as a weights-only checkpoint ({type(exc).__name__})") from None
        if not isinstance(state, dict):
            raise RdepthError(f"{bin_path} does not hold a state dict")
        return state
    raise RdepthError(f"{directory} has neither model.safetensors nor pytorch_model.bin")


def load_hf_teacher(directory: str | Path) -> Teacher:
    """Build a :class:`Teacher` (eval mode, frozen) from a Hugging Face checkpoint directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise RdepthError(f"teacher directory {directory} does not exist")
    config_path = directory / "config.json"
    config = read_json_object(config_path, "teacher config")
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise RdepthError(f"{config_path}: model_type {model_type!r} is not supported (supported: {sorted(ARCHITECTURES)})")
    try:
        teacher = ARCHITECTURES[model_type](config, _Weights(read_state_dict(directory), directory))
    except KeyError as exc:
        raise RdepthError(f"{config_path} lacks the field {exc.args[0]!r}") from None
    teacher.eval()
    teacher.requires_grad_(False)
    log.info("loaded %s teacher from %s: %d layers, d=%d", model_type, directory, teacher.n_layers, teacher.spec.d_model)
    return teacher
