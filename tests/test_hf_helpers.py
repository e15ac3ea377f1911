"""Shared builders for the ``test_hf_*`` tests (no tests here): tiny rdepth runs on disk, the CLI."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import torch

WORDS = ["the", "a", "river", "city", "old", "new", "small", "large", "north", "south", "king", "queen", "museum", "library", "station", "garden", "bridge", "tower", "market", "school", "village", "forest", "mountain", "lake", "island", "road", "castle", "hill", "town", "wall"]


def sentences(count: int, seed: int = 1) -> list[str]:
    """Random short sentences over a small vocabulary (a corpus for a tiny BPE and held-out text)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        length = int(torch.randint(5, 11, (1,), generator=generator))
        words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,), generator=generator)]
        out.append(" ".join(words).capitalize() + ".")
    return out


_TOKENIZER = {}


def tiny_tokenizer():
    """A 320-token byte-level BPE trained once per session on :func:`sentences`."""
    from rdepth.data.tokenizers import train_bpe

    if "bpe" not in _TOKENIZER:
        _TOKENIZER["bpe"] = train_bpe(sentences(300), 320, name="bpe:320")
    return _TOKENIZER["bpe"]


def tiny_run(folder: Path, groups: str = "1|2-3", n_layer: int = 5, seed: int = 0, tokenizer=None, **fields):
    """A random rdepth run folder (checkpoint + tokenizer) as training leaves it: ``(run, model)``."""
    from rdepth.config import get_preset
    from rdepth.model import RecurrentLM
    from rdepth.run.checkpoint import save_checkpoint

    tokenizer = tokenizer or tiny_tokenizer()
    values = dict(n_layer=n_layer, n_head=2, d_model=32, block_size=64, vocab_size=tokenizer.vocab_size,
                  groups=groups, tokenizer=tokenizer.name, mean_loops=3.0, backprop_depth=2)
    values.update(fields)
    torch.manual_seed(seed)
    config = get_preset("tiny", **values)
    model = RecurrentLM(config).eval()
    save_checkpoint(folder, 7, model, config)
    tokenizer.save(folder / "tokenizer")
    return folder, model


def real(logits: torch.Tensor) -> torch.Tensor:
    """The exported logits' real vocabulary: all but the last column, the export's own pad token's (one past the
    vocabulary), which is -inf, so that softmax and log-softmax over every column equal, bit for bit, those
    over the real ones (what lm-eval and transformers' sampling read)."""
    assert torch.isneginf(logits[..., -1]).all()
    body = logits[..., :-1]
    assert torch.equal(logits.softmax(-1)[..., :-1], body.softmax(-1))
    assert torch.equal(logits.log_softmax(-1)[..., :-1], body.log_softmax(-1))
    return body


def cli(monkeypatch, *args) -> int:
    """``rdepth ARGS`` through the real entry point, with this work's subcommands registered."""
    import rdepth.cli.main as cli_main

    names = list(cli_main.SUBCOMMANDS)
    for name in ("export", "import_hf", "retrofit", "lmeval"):
        if name not in names:
            names.append(name)
    monkeypatch.setattr(cli_main, "SUBCOMMANDS", names)
    return cli_main.main([str(a) for a in args])


def one_line_error(capsys, code: int) -> str:
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err
    return err
