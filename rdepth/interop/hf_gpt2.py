"""GPT-2 Hugging Face folders as plain rdepth models (``block="gpt2"``), weight for weight.

A GPT-2 folder (``config.json`` with ``model_type: gpt2``, ``model.safetensors`` or
``pytorch_model.bin``) maps onto a :class:`~rdepth.model.RecurrentLM` with no
recurrence groups and GPT-2 blocks:

==============================  ==========================  =====================
GPT-2 (``transformer.`` prefix)  rdepth                      note
==============================  ==========================  =====================
``wte`` / ``wpe``                ``wte`` / ``wpe``           wte padded to 64 rows
``h.i.ln_1`` / ``h.i.ln_2``      ``layers.i.norm_1/norm_2``  LayerNorm
``h.i.attn.c_attn``              ``layers.i.attn.qkv``       Conv1D: transposed
``h.i.attn.c_proj``              ``layers.i.attn.proj``      Conv1D: transposed
``h.i.mlp.c_fc`` / ``c_proj``    ``layers.i.mlp.fc/proj``    Conv1D: transposed
``ln_f``                         ``norm_f``
``lm_head``                      (tied to ``wte``)           must equal wte
==============================  ==========================  =====================

Settings rdepth's GPT-2 block does not compute (another activation, attention not
scaled by 1/sqrt(head_dim), scaling by layer index, an untied head) are refused with
the setting named. The tokenizer: GPT-2's own BPE when ``vocab.json``/``merges.txt``
are GPT-2's (rdepth's exact ``gpt2`` tokenizer), else the folder's ``tokenizer.json``
as a byte-level BPE. The imported model is plain (``groups=""``); ``rdepth retrofit``
then loops chosen layers, starting exactly where the model was.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rdepth.config import ModelConfig
from rdepth.data.tokenizers import BPE_FILE, META_FILE
from rdepth.errors import RdepthError
from rdepth.interop.hf_weights import has_safetensors, read_hub_weights
from rdepth.model import RecurrentLM
from rdepth.run.checkpoint import check_weight_values

# GPT-2's activation names that are the tanh approximation rdepth's gpt2 block computes
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# HF's non-parameter buffers in older GPT-2 checkpoints (the causal mask), skipped
BUFFERS = (("attn", "bias"), ("attn", "masked_bias"))


def gpt2_model_config(folder: Path, hf: dict) -> dict:
    """rdepth ModelConfig fields for the GPT-2 ``config.json`` ``hf``; refuses what rdepth cannot compute."""
    def need(key: str) -> int:
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise RdepthError(f"{folder}: GPT-2 config.json has no integer {key!r}")
        return value

    d_model = need("n_embd")
    refusals = []
    activation = hf.get("activation_function", "gelu_new")
    if activation not in TANH_GELUS:
        refusals.append(f"activation_function {activation!r} (rdepth's gpt2 block computes GELU-tanh: "
                        f"{', '.join(TANH_GELUS)})")
    if hf.get("scale_attn_weights", True) is not True:
        refusals.append("scale_attn_weights false (rdepth scales attention by 1/sqrt(head_dim))")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        refusals.append("scale_attn_by_inverse_layer_idx")
    if hf.get("tie_word_embeddings", True) is False:
        refusals.append("an untied output head (rdepth ties it to the token embedding)")
    inner = hf.get("n_inner") or 4 * d_model
    if inner % d_model:
        refusals.append(f"n_inner {inner} (rdepth's MLP is a whole multiple of n_embd {d_model})")
    if refusals:
        raise RdepthError(f"cannot import {folder} (gpt2): rdepth's gpt2 block does not compute "
                          + "; ".join(refusals))
    return dict(
        block="gpt2", n_layer=need("n_layer"), n_head=need("n_head"), d_model=d_model,
        block_size=need("n_positions"), vocab_size=need("vocab_size"), mlp_ratio=inner // d_model,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), groups="", mean_loops=1.0,
        backprop_depth=1, init_state_scale=1.0,
    )


def read_gpt2_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors (its safetensors weights as :mod:`rdepth.interop.hf_weights` reads them, else
    ``pytorch_model.bin`` with ``weights_only=True``), without the ``transformer.`` prefix and the mask
    buffers."""
    torch_path = folder / "pytorch_model.bin"
    if has_safetensors(folder):
        raw = read_hub_weights(folder, check_values=False)  # checked below, less the mask buffers
    elif torch_path.is_file():
        try:
            raw = torch.load(torch_path, map_location="cpu", weights_only=True)
            if not isinstance(raw, dict):
                raise ValueError("not a state dict")
        except (OSError, ValueError, RuntimeError, EOFError) as exc:
            raise RdepthError(f"weights in {folder} are corrupt or truncated ({exc})") from None
    else:
        raise RdepthError(f"{folder} has no model.safetensors or pytorch_model.bin")
    weights = {}
    for name, tensor in raw.items():
        name = name.removeprefix("transformer.")
        if tuple(name.split(".")[-2:]) in BUFFERS:  # h.i.attn.bias, not h.i.attn.c_attn.bias
            continue
        weights[name] = tensor
    check_weight_values(folder, weights)
    return weights


def gpt2_state_dict(folder: Path, weights: dict[str, torch.Tensor], model: RecurrentLM) -> dict[str, torch.Tensor]:
    """rdepth names and layouts for GPT-2's ``weights``, checked against ``model``'s shapes."""
    config = model.config
    mapped: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(name: str, transpose: bool = False) -> torch.Tensor:
        if name not in weights:
            raise RdepthError(f"{folder}: GPT-2 weight {name!r} is missing")
        used.add(name)
        tensor = weights[name].float()
        return tensor.t().contiguous() if transpose else tensor

    wte = take("wte.weight")
    padded = torch.zeros(config.padded_vocab_size, config.d_model)
    if wte.shape != (config.vocab_size, config.d_model):
        raise RdepthError(f"{folder}: wte.weight has shape {tuple(wte.shape)}, config.json implies "
                          f"{(config.vocab_size, config.d_model)}")
    padded[: config.vocab_size] = wte  # rows past the vocabulary are never read out
    mapped["wte.weight"] = padded
    mapped["wpe.weight"] = take("wpe.weight")
    for i in range(config.n_layer):
        source, target = f"h.{i}.", f"layers.{i}."
        for hf_name, name, transpose in (("ln_1", "norm_1", False), ("ln_2", "norm_2", False),
                                         ("attn.c_attn", "attn.qkv", True), ("attn.c_proj", "attn.proj", True),
                                         ("mlp.c_fc", "mlp.fc", True), ("mlp.c_proj", "mlp.proj", True)):
            mapped[target + name + ".weight"] = take(source + hf_name + ".weight", transpose)  # Conv1D is [in, out]
            mapped[target + name + ".bias"] = take(source + hf_name + ".bias")
    mapped["norm_f.weight"] = take("ln_f.weight")
    mapped["norm_f.bias"] = take("ln_f.bias")
    if "lm_head.weight" in weights:
        used.add("lm_head.weight")
        if not torch.equal(weights["lm_head.weight"].float(), wte):
            raise RdepthError(f"cannot import {folder} (gpt2): its lm_head differs from wte, and rdepth ties "
                              "the output head to the token embedding")
    unexpected = sorted(set(weights) - used)
    if unexpected:
        raise RdepthError(f"{folder}: unexpected GPT-2 weights {unexpected[:3]}")
    expected = model.state_dict()
    for name, tensor in mapped.items():
        if tensor.shape != expected[name].shape:
            raise RdepthError(f"{folder}: weight {name} has shape {tuple(tensor.shape)}, its config implies "
                              f"{tuple(expected[name].shape)}")
    return mapped


def gpt2_tokenizer_files(folder: Path, vocab_size: int) -> tuple[str, dict[str, str | None]]:
    """(tokenizer spec, files to write into the run's tokenizer folder) for a GPT-2 folder."""
    if (vocab_size == 50257 and (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
            and _is_gpt2_bpe(folder)):
        return "gpt2", {META_FILE: None}
    path = folder / "tokenizer.json"
    if path.is_file():
        return f"bpe:{vocab_size}", {META_FILE: None, BPE_FILE: path.read_text()}
    raise RdepthError(f"{folder} has no tokenizer: neither GPT-2's vocab.json/merges.txt nor a tokenizer.json")


def _is_gpt2_bpe(folder: Path) -> bool:
    """Whether the folder's vocab.json and merges.txt are GPT-2's (compared with rdepth's pinned files)."""
    from rdepth.data.fetch import gpt2_bpe_files

    files = gpt2_bpe_files()
    try:
        same_vocab = json.loads((folder / "vocab.json").read_text()) == json.loads(files["encoder.json"].read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False

    def merges(path: Path) -> list[str]:
        return [line for line in path.read_text().splitlines() if line and not line.startswith("#version")]

    return same_vocab and merges(folder / "merges.txt") == merges(files["vocab.bpe"])


def import_gpt2(folder: Path, hf_config: dict) -> tuple[RecurrentLM, dict]:
    """A GPT-2 folder: the plain rdepth model with GPT-2 blocks, and the tokenizer files to save."""
    values = gpt2_model_config(folder, hf_config)
    spec, tokenizer_files = gpt2_tokenizer_files(folder, values["vocab_size"])
    model = RecurrentLM(ModelConfig.from_dict({**values, "tokenizer": spec}))
    model.load_state_dict(gpt2_state_dict(folder, read_gpt2_weights(folder), model))
    return model.eval(), tokenizer_files
