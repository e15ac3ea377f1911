"""Huginn-0125 / "raven" folders (``model_type: huginn_raven``, Geiping et al.) as rdepth models.

Raven's model is rdepth's sandwich model with four options on (``ModelConfig``): rotary positions
over adjacent channel pairs (``positions="rotary"``, ``rope_base``), a gated SiLU MLP
(``mlp="swiglu"``, ``mlp_hidden`` = its ``intermediate_size``), a query/key bias (``qk_bias``) and
the final norm applied to the state the recurrent block hands to the coda as well as before the
head (``handoff_norm``: its ``ln_f`` is used twice). The rest is rdepth's already: the embedding
times sqrt(d), the adapter on ``concat(state, embedding)``, an initial state drawn from the
3-sigma truncated normal of std sqrt(2/(5d)) times sqrt(d), the head tied to the embedding.

=======================================  ==========================  ==============================
raven (``transformer.`` prefix)           rdepth                      note
=======================================  ==========================  ==============================
``wte``                                   ``wte``                     padded to 64 rows
``prelude.i`` / ``core_block.i`` /        ``layers.(P+...)``          prelude P, core R, coda C
``coda.i``                                                            layers; the core is group 0
``*.attn.Wqkv`` / ``*.attn.proj``         ``*.attn.qkv`` / ``proj``   rows: queries, keys, values
``*.attn.qk_bias`` ``[2, 1, nh, hs]``     ``*.attn.qk_bias``          ``[2, nh, hs]``
``*.mlp.fc`` / ``*.mlp.proj``             the same                    fc rows: gate, then up
``*.norm_1`` .. ``*.norm_4``              the same                    sandwich norms
``adapter``                               ``adapters.0``              ``[d, 2d]``: state, embedding
``ln_f``                                  ``norm_f``                  hand-off and readout
``lm_head`` (top level)                   tied to ``wte``             must equal wte when present
``freqs_cis`` (top level)                 (computed)                  checked against rdepth's table
=======================================  ==========================  ==============================

Loop counts: raven's ``num_steps`` is the core block's number of iterations, rdepth's loop count of
its one group (``eval_loops`` = its ``mean_recurrence``, the reference's evaluation default). Its
training draw is ``1 + Poisson(lognormal of mean mean_recurrence)`` iterations, rdepth's with
``mean_loops = mean_recurrence + 1``. Settings rdepth does not compute are refused with the field
named. :func:`write_raven_folder` writes a small random raven-layout folder from a seed (tests,
golden files), without ``transformers``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from rdepth.config import ModelConfig, check_fits_memory
from rdepth.data.tokenizers import BPE_FILE, META_FILE, MIN_BPE_VOCAB
from rdepth.errors import RdepthError
from rdepth.interop.hf_weights import read_hub_weights
from rdepth.model import RecurrentLM

MODEL_TYPE = "huginn_raven"
PREFIX = "transformer."
# Raven's per-layer tensors -> rdepth's (the qk bias is reshaped)
LAYER_NAMES = {
    "attn.Wqkv.weight": "attn.qkv.weight", "attn.qk_bias": "attn.qk_bias", "attn.proj.weight": "attn.proj.weight",
    "mlp.fc.weight": "mlp.fc.weight", "mlp.proj.weight": "mlp.proj.weight",
    **{f"norm_{i}.weight": f"norm_{i}.weight" for i in range(1, 5)},
}
# Fields whose value rdepth computes only as the reference's released model has it: field -> allowed
FIXED = {
    "architecture_class_name": ("RecurrentGPT",), "block_class_name": ("SandwichBlock",),
    "norm_class_name": ("RMSNorm_llama",), "mlp_class_name": ("GatedMLP",), "nonlin_name": ("SiLU",),
    "injection_type": ("linear",), "state_init": ("like-init",), "bias": (False,),
    "tie_embeddings": (True,), "tie_word_embeddings": (True,), "test_time_noise": (0, 0.0),
}
# What the reference's RavenConfig takes when a field is absent
DEFAULTS = {"rope_base": 50_000.0, "qk_bias": True, "norm_eps": 1e-6}


def raven_model_config(folder: Path, hf: dict) -> dict:
    """rdepth ModelConfig fields for the raven ``config.json`` ``hf``; one error naming every field rdepth
    cannot honour."""
    def need(key: str) -> int:
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise RdepthError(f"{folder}: raven config.json has no integer {key!r}")
        return value

    refusals = [f"{key} {hf[key]!r} (rdepth computes {' or '.join(map(repr, allowed))})"
                for key, allowed in FIXED.items() if key in hf and hf[key] not in allowed]
    heads = {hf[key] for key in ("n_heads", "num_attention_heads") if key in hf}
    if len(heads) != 1:
        raise RdepthError(f"{folder}: raven config.json needs one head count (n_heads / num_attention_heads), "
                          f"got {sorted(heads, key=repr)}")
    n_head = heads.pop()
    if hf.get("num_key_value_heads", n_head) != n_head:
        refusals.append(f"num_key_value_heads {hf['num_key_value_heads']!r} (grouped-query attention; rdepth's "
                        f"attention has as many key/value heads as query heads, {n_head})")
    width = hf.get("n_embd")
    if "head_dim" in hf and isinstance(width, int) and isinstance(n_head, int) and n_head > 0 \
            and hf["head_dim"] != width // n_head:
        refusals.append(f"head_dim {hf['head_dim']!r} (rdepth's heads are n_embd / heads = {width // n_head} wide)")
    if hf.get("padded_vocab_size", hf.get("vocab_size")) != hf.get("vocab_size"):
        refusals.append(f"padded_vocab_size {hf['padded_vocab_size']!r} other than vocab_size {hf.get('vocab_size')!r}")
    if refusals:
        raise RdepthError(f"cannot import {folder} ({MODEL_TYPE}): rdepth's model does not compute "
                          + "; ".join(refusals))
    prelude, core, coda = need("n_layers_in_prelude"), need("n_layers_in_recurrent_block"), need("n_layers_in_coda")
    if core < 1:
        raise RdepthError(f"{folder}: raven config.json has n_layers_in_recurrent_block {core}; rdepth needs >= 1")
    recurrence = need("mean_recurrence")
    return dict(
        block="sandwich", positions="rotary", mlp="swiglu", handoff_norm=True, loop_state="sandwich",
        n_layer=prelude + core + coda, groups=f"{prelude}-{prelude + core - 1}", n_head=n_head, d_model=need("n_embd"),
        block_size=need("block_size"), vocab_size=need("vocab_size"), mlp_hidden=need("intermediate_size"),
        rope_base=float(hf.get("rope_base", DEFAULTS["rope_base"])), qk_bias=bool(hf.get("qk_bias", DEFAULTS["qk_bias"])),
        norm_eps=float(hf.get("norm_eps", DEFAULTS["norm_eps"])), mean_loops=float(recurrence + 1), loop_sigma=0.5,
        backprop_depth=max(1, need("mean_backprop_depth")), eval_loops=(max(1, recurrence),), init_state_scale=1.0,
    )


def _layer_sources(config: ModelConfig) -> list[str]:
    """Raven's prefix of each rdepth layer, in order (``prelude.0.`` ...)."""
    core = config.group_specs[0]
    prelude, coda = core.start, config.n_layer - core.end - 1
    return ([f"prelude.{i}." for i in range(prelude)] + [f"core_block.{i}." for i in range(len(core.layers))]
            + [f"coda.{i}." for i in range(coda)])


def raven_state_dict(folder: Path, weights: dict[str, torch.Tensor], model: RecurrentLM) -> dict[str, torch.Tensor]:
    """rdepth names and layouts for raven's ``weights``, every tensor used once and checked against ``model``."""
    config = model.config
    expected = model.state_dict()
    mapped: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise RdepthError(f"{folder}: raven weight {name!r} is missing")
        used.add(name)
        return weights[name].float()

    def put(name: str, tensor: torch.Tensor, source: str) -> None:
        if tensor.shape != expected[name].shape:
            raise RdepthError(f"{folder}: raven weight {source!r} has shape {tuple(weights[source].shape)}, its "
                              f"config.json implies {tuple(expected[name].shape)}")
        mapped[name] = tensor

    wte = take(PREFIX + "wte.weight")
    if wte.shape != (config.vocab_size, config.d_model):
        raise RdepthError(f"{folder}: raven weight 'transformer.wte.weight' has shape {tuple(wte.shape)}, its "
                          f"config.json implies {(config.vocab_size, config.d_model)}")
    padded = torch.zeros(config.padded_vocab_size, config.d_model)
    padded[: config.vocab_size] = wte  # rows past the vocabulary are never read out
    mapped["wte.weight"] = padded
    for index, source in enumerate(_layer_sources(config)):
        for raven_name, name in LAYER_NAMES.items():
            if raven_name == "attn.qk_bias" and not config.qk_bias:
                continue
            tensor = take(PREFIX + source + raven_name)
            if raven_name == "attn.qk_bias" and tensor.dim() == 4 and tensor.shape[1] == 1:
                tensor = tensor.squeeze(1)  # (2, 1, nh, hs) -> (2, nh, hs)
            put(f"layers.{index}.{name}", tensor, PREFIX + source + raven_name)
    put("adapters.0.weight", take(PREFIX + "adapter.weight"), PREFIX + "adapter.weight")
    put("norm_f.weight", take(PREFIX + "ln_f.weight"), PREFIX + "ln_f.weight")
    if "lm_head.weight" in weights and not torch.equal(take("lm_head.weight"), wte):
        raise RdepthError(f"cannot import {folder} ({MODEL_TYPE}): its lm_head differs from wte, and rdepth "
                          "ties the output head to the token embedding")
    if "freqs_cis" in weights:
        _check_rotary_table(folder, take("freqs_cis"), model)
    unexpected = sorted(set(weights) - used)
    if unexpected:
        raise RdepthError(f"{folder}: unexpected raven weights {unexpected[:3]}")
    return mapped


def _check_rotary_table(folder: Path, stored: torch.Tensor, model: RecurrentLM) -> None:
    """The reference's saved rotary buffer ``[1, S, 1, hs/2, 2]`` must be the table rdepth computes (to the
    precision it was stored in): another base or layout would change every logit."""
    table = model.rotary.table(torch.device("cpu"))
    shape = (1, table.shape[0], 1, *table.shape[1:])
    if tuple(stored.shape) != shape:
        raise RdepthError(f"{folder}: raven buffer 'freqs_cis' has shape {tuple(stored.shape)}, its config.json "
                          f"implies {shape}")
    if not torch.allclose(stored.view(shape[1:2] + shape[3:]), table, rtol=0, atol=1e-2):
        raise RdepthError(f"{folder}: raven buffer 'freqs_cis' differs from the rotary table of rope_base "
                          f"{model.config.rope_base} (another base or pair layout)")


def raven_tokenizer_files(folder: Path, vocab_size: int) -> tuple[str, dict[str, str | None]]:
    """(tokenizer spec, files for the run's tokenizer folder): the folder's ``tokenizer.json`` as a BPE, and its
    chat template where it has one (``rdepth serve``'s /v1/chat/completions reads it)."""
    from rdepth.run.chat_template import CHAT_TEMPLATE_FILE, hub_chat_template

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise RdepthError(f"{folder} has no tokenizer.json")
    files = {META_FILE: None, BPE_FILE: path.read_text()}
    template = hub_chat_template(folder)
    if template is not None:
        files[CHAT_TEMPLATE_FILE] = template.to_json()
    return f"bpe:{vocab_size}", files


def raven_model(folder: str | Path, tokenizer: str | None = None) -> RecurrentLM:
    """The rdepth model (float32, eval mode) of the raven folder ``folder`` (``tokenizer``: the spec its
    config records; default ``bpe:<vocab_size>``)."""
    from rdepth.io import read_json_object

    folder = Path(folder)
    values = raven_model_config(folder, read_json_object(folder / "config.json", "Hugging Face config"))
    return hub_model(folder, MODEL_TYPE, values, tokenizer,
                     lambda model: raven_state_dict(folder, read_hub_weights(folder), model))


def hub_model(folder: Path, model_type: str, values: dict, tokenizer: str | None,
              state_dict: Callable[[RecurrentLM], dict]) -> RecurrentLM:
    """The rdepth model (float32, eval mode) of a hub folder whose config maps to ``values``: its size checked
    against the memory first, built on the meta device, its parameters the tensors ``state_dict(model)``
    gives (no init, no second copy)."""
    config = ModelConfig.from_dict({**values, "tokenizer": tokenizer or f"bpe:{values['vocab_size']}"})
    check_fits_memory(config, f"cannot import {folder} ({model_type})")  # before anything is allocated
    with torch.device("meta"):
        model = RecurrentLM(config)
    model.load_state_dict(state_dict(model), assign=True)
    return model.eval()


def import_raven(folder: Path, hf_config: dict) -> tuple[RecurrentLM, dict]:
    """A raven folder: the rdepth model (float32, eval mode) and the tokenizer files to save."""
    if hf_config.get("model_type") != MODEL_TYPE:
        raise RdepthError(f"{folder}: model_type {hf_config.get('model_type')!r} is not {MODEL_TYPE!r}")
    vocab_size = raven_model_config(folder, hf_config)["vocab_size"]
    if vocab_size < MIN_BPE_VOCAB:
        raise RdepthError(f"cannot import {folder} ({MODEL_TYPE}): its vocabulary has {vocab_size} tokens; rdepth "
                          f"reads its tokenizer.json as a byte-level BPE, which holds at least {MIN_BPE_VOCAB} (256 "
                          "bytes and the end token)")
    spec, tokenizer_files = raven_tokenizer_files(folder, vocab_size)
    return raven_model(folder, spec), tokenizer_files


# The field values of Huginn-0125's published config.json (recpre/raven_config_minimal.json in
# seal-rg/recurrent-pretraining), as data.
HUGINN_0125 = dict(
    model_type="huginn_raven", block_size=4096, vocab_size=65536, padding_multiple=4096, tie_embeddings=True,
    num_attention_heads=55, num_key_value_heads=55, n_embd=5280, intermediate_size=17920, bias=False,
    architecture_class_name="RecurrentGPT", block_class_name="SandwichBlock", norm_class_name="RMSNorm_llama",
    norm_eps=1e-6, mlp_class_name="GatedMLP", nonlin_name="SiLU", init_strategy="takase", init_orthogonal=False,
    state_init="like-init", injection_type="linear", n_layers_in_recurrent_block=4, mean_recurrence=32,
    sampling_scheme="poisson-lognormal-filling", mean_backprop_depth=8, n_layers_in_prelude=2, n_layers_in_coda=2,
    qk_bias=True, activation_checkpoint_impl="per-iteration", torch_dtype="bfloat16",
)


# ------------------------------------------------------------------ a tiny raven-layout folder
TINY_RAVEN = dict(n_embd=32, n_heads=4, intermediate_size=48, n_layers_in_prelude=1, n_layers_in_recurrent_block=2,
                  n_layers_in_coda=1, block_size=64, vocab_size=96, mean_recurrence=4, mean_backprop_depth=2,
                  rope_base=50_000.0, norm_eps=1e-6, qk_bias=True)


def raven_config_json(**overrides) -> dict:
    """A raven ``config.json`` of :data:`TINY_RAVEN` (fields as the reference's RavenConfig names them)."""
    fields = {**TINY_RAVEN, **overrides}
    return {
        "model_type": MODEL_TYPE, "architectures": ["RavenForCausalLM"], "tie_embeddings": True,
        "bias": False, "architecture_class_name": "RecurrentGPT", "block_class_name": "SandwichBlock",
        "norm_class_name": "RMSNorm_llama", "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU",
        "injection_type": "linear", "state_init": "like-init", "sampling_scheme": "poisson-lognormal-filling",
        "padding_multiple": 1, "num_key_value_heads": fields["n_heads"], "torch_dtype": "float32", **fields,
    }


def raven_weight_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter of a raven checkpoint with its shape, in the reference's names and order (the tied
    head left out, as its safetensors files leave it; the rotary buffer ``freqs_cis`` is no parameter)."""
    d, n_head, hidden = hf["n_embd"], hf["n_heads"], hf["intermediate_size"]
    layer = {"norm_1.weight": (d,), "attn.Wqkv.weight": (3 * d, d),
             **({"attn.qk_bias": (2, 1, n_head, d // n_head)} if hf.get("qk_bias", True) else {}),
             "attn.proj.weight": (d, d), "norm_2.weight": (d,), "mlp.fc.weight": (2 * hidden, d),
             "mlp.proj.weight": (d, hidden), "norm_3.weight": (d,), "norm_4.weight": (d,)}
    shapes = {PREFIX + "wte.weight": (hf["vocab_size"], d)}
    for part, count in (("prelude", "n_layers_in_prelude"), ("adapter", None),
                        ("core_block", "n_layers_in_recurrent_block"), ("coda", "n_layers_in_coda")):
        if count is None:
            shapes[PREFIX + "adapter.weight"] = (d, 2 * d)
            continue
        for i in range(hf[count]):
            shapes.update({f"{PREFIX}{part}.{i}.{name}": shape for name, shape in layer.items()})
    shapes[PREFIX + "ln_f.weight"] = (d,)
    return shapes


def write_raven_folder(folder: str | Path, seed: int = 0, tokenizer_json: str | None = None,
                       **overrides) -> Path:
    """A random raven-layout folder: ``config.json`` (:func:`raven_config_json` with ``overrides``) and
    ``model.safetensors``, every parameter drawn from a generator seeded with ``seed`` in the order of
    :func:`raven_weight_shapes` (matrices ~ N(0, 1/d), norm gains 1 + N(0, 0.2^2), the qk bias
    N(0, 0.2^2): all of them matter), and the rotary buffer ``freqs_cis`` ``[1, S, 1, hs/2, 2]`` as the
    reference saves it; a ``tokenizer.json`` when given."""
    from safetensors.torch import save_file

    from rdepth.model.layers import Rotary

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf = raven_config_json(**overrides)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in raven_weight_shapes(hf).items():
        noise = torch.randn(shape, generator=generator, dtype=torch.float64)
        if len(shape) == 1:
            weights[name] = 1.0 + 0.2 * noise
        elif name.endswith("qk_bias"):
            weights[name] = 0.2 * noise
        else:
            weights[name] = noise / shape[-1] ** 0.5
    head_dim = hf["n_embd"] // hf["n_heads"]
    table = Rotary(head_dim, hf["rope_base"], hf["block_size"]).table(torch.device("cpu"))
    weights["freqs_cis"] = table.view(1, hf["block_size"], 1, head_dim // 2, 2)
    save_file({name: tensor.float().contiguous() for name, tensor in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if tokenizer_json is not None:
        (folder / "tokenizer.json").write_text(tokenizer_json)
    return folder
