"""load_model builds the model on the meta device and takes the checkpoint's tensors as its parameters:
no memory or random initialisation spent on weights about to be replaced (issue 43: ~100 host reads
of trunc_normal_ for `tiny`, seconds to minutes at billions of parameters), and the same model."""

from __future__ import annotations

import torch

from rdepth.config import get_preset
from rdepth.model import RecurrentLM
from rdepth.model.noise import StateNoise
from rdepth.run.checkpoint import load_model, save_checkpoint


def test_a_loaded_model_is_not_initialised_first_and_equals_the_saved_one(tmp_path, monkeypatch):
    torch.manual_seed(0)
    config = get_preset("tiny", n_layer=4, d_model=64, n_head=2, block_size=32, vocab_size=96, groups="1|2")
    model = RecurrentLM(config).eval()
    save_checkpoint(tmp_path / "run", 3, model, config, state={})
    inits = []
    original = torch.nn.init.trunc_normal_

    def counting(tensor, *args, **kwargs):
        inits.append(tensor.device.type)
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "trunc_normal_", counting)
    loaded, loaded_config = load_model(tmp_path / "run")
    assert loaded_config == config
    assert inits and set(inits) == {"meta"}  # the init ran on meta tensors only: no memory, no host reads
    for name, tensor in model.state_dict().items():
        got = loaded.state_dict()[name]
        assert got.device.type == "cpu" and got.dtype == tensor.dtype and torch.equal(got, tensor), name
    assert all(not p.is_meta for p in loaded.parameters()) and not loaded.training
    idx = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(idx, noise=StateNoise(0, [0, 1])).logits,
                           model(idx, noise=StateNoise(0, [0, 1])).logits)
