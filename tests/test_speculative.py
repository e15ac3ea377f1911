"""Self-speculative decoding gives plain greedy decoding's tokens exactly."""

from __future__ import annotations

import pytest
import torch

from rdepth.config import ModelConfig
from rdepth.exits.controller import controller_factory
from rdepth.model import RecurrentLM
from rdepth.model.generation import generate
from rdepth.model.noise import StateNoise
from rdepth.model.speculative import speculative_generate


def tiny(block_size: int = 24) -> RecurrentLM:
    torch.manual_seed(3)
    config = ModelConfig(n_layer=4, n_head=2, d_model=16, block_size=block_size, vocab_size=12, groups="1|2",
                         mean_loops=3.0, backprop_depth=2, tokenizer="bpe:12")
    return RecurrentLM(config).double().eval()


@pytest.mark.parametrize("draft_tokens", [1, 3, 6])
def test_greedy_output_equals_plain_decoding(draft_tokens):
    model, prompt = tiny(), torch.tensor([[1, 5, 7]])
    plain = generate(model, prompt, 14, temperature=0.0, loop_counts=(4, 5), noise=StateNoise(9, [0]))
    fast, stats = speculative_generate(model, prompt, 14, draft_loops=1, loop_counts=(4, 5),
                                       draft_tokens=draft_tokens, noise=StateNoise(9, [0]))
    assert torch.equal(fast, plain)
    assert stats.drafted > 0 and 0 <= stats.accepted <= stats.drafted


def test_drafting_at_the_verifying_budget_accepts_everything():
    model, prompt = tiny(), torch.tensor([[2, 3]])
    fast, stats = speculative_generate(model, prompt, 12, draft_loops=(4, 5), loop_counts=(4, 5),
                                       draft_tokens=4, noise=StateNoise(1, [0]))
    plain = generate(model, prompt, 12, temperature=0.0, loop_counts=(4, 5), noise=StateNoise(1, [0]))
    assert torch.equal(fast, plain) and stats.acceptance == 1.0


def test_with_exits_and_at_the_block_size():
    """Verification with a per-token exit policy, running into the block size."""
    model, prompt = tiny(block_size=12), torch.tensor([[4, 1, 9]])

    def controller():
        return controller_factory("kl", 1e-3, 6, lambda: model.readout)()

    plain = generate(model, prompt, 30, temperature=0.0, controller_factory=controller, noise=StateNoise(2, [0]))
    fast, _ = speculative_generate(model, prompt, 30, draft_loops=1, controller_factory=controller,
                                   draft_tokens=3, noise=StateNoise(2, [0]))
    assert plain.shape[1] == 13  # generation stops at the block size (block + 1 tokens)
    assert torch.equal(fast, plain)


def test_generate_command_with_draft_loops(wiki_small, tmp_path, capsys):
    from rdepth.cli.main import main

    run = tmp_path / "run"
    assert main(["train", "--data", str(wiki_small), "--out", str(run), "--max-steps", "3", "--batch-size", "2",
                 "--n-layer", "3", "--n-head", "2", "--d-model", "16", "--block-size", "32", "--groups", "1",
                 "--mean-loops", "3", "--backprop-depth", "2", "--eval-batches", "1", "--log-every", "1"]) == 0
    common = ["generate", "--checkpoint", str(run), "--prompt", "The river", "--max-new-tokens", "12",
              "--temperature", "0"]
    capsys.readouterr()
    assert main(common) == 0
    plain = capsys.readouterr().out
    assert main(common + ["--speculate", "3", "--draft-loops", "1"]) == 0
    assert capsys.readouterr().out == plain
    assert main(common + ["--draft-loops", "1"]) == 2  # the drafts of --speculate K, not alone
    assert "give --speculate too" in capsys.readouterr().err


def test_generated_text_hides_special_tokens_and_eval_on_text_has_a_baseline(wiki_small, tmp_path, capsys):
    """Issue 17: <|endoftext|> is hidden unless --show-special; eval on a text file scores the
    run's training unigrams on the same tokens."""
    from rdepth.cli.main import main

    run = tmp_path / "run"
    assert main(["train", "--data", str(wiki_small), "--out", str(run), "--max-steps", "2", "--batch-size", "2",
                 "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--block-size", "32", "--groups", "1",
                 "--mean-loops", "2", "--backprop-depth", "2", "--eval-batches", "1", "--log-every", "1"]) == 0
    common = ["generate", "--checkpoint", str(run), "--prompt", "The river<|endoftext|>A town",
              "--max-new-tokens", "4", "--temperature", "0"]
    capsys.readouterr()
    assert main(common) == 0
    assert "<|endoftext|>" not in capsys.readouterr().out
    assert main(common + ["--show-special"]) == 0
    assert "<|endoftext|>" in capsys.readouterr().out
    text = tmp_path / "held.txt"
    text.write_text("The river runs north of the town and the old bridge crosses it. " * 20)
    assert main(["eval", "--checkpoint", str(run), "--data", str(text), "--loops", "1"]) == 0
    printed = capsys.readouterr().out
    assert "unigram baseline" in printed and "the same" in printed


def _template(length: int = 22, seed: int = 5):
    """Given tokens with free positions in runs of one to three (a problem with answers between queries)."""
    generator = torch.Generator().manual_seed(seed)
    template = torch.randint(0, 12, (1, length), generator=generator)
    free = torch.zeros(length, dtype=torch.bool)
    free[[4, 7, 8, 11, 14, 15, 16, 19, 21]] = True
    return template, free


def test_greedy_fill_is_the_argmax_of_uncached_forwards():
    from rdepth.model.speculative import greedy_fill

    model = tiny()
    template, free = _template()
    filled = greedy_fill(model, template, free, loop_counts=(4, 5), noise=StateNoise(4, [0]))
    expected = template.clone()
    for position in torch.nonzero(free).flatten().tolist():
        logits = model(expected[:, :position], loop_counts=(4, 5), noise=StateNoise(4, [0])).logits
        expected[0, position] = logits[0, -1].argmax()
    assert torch.equal(filled, expected)
    assert torch.equal(filled[0, ~free], template[0, ~free])  # given tokens stay


@pytest.mark.parametrize("draft_tokens", [1, 2, 5])
def test_speculative_fill_equals_greedy_fill(draft_tokens):
    from rdepth.model.speculative import greedy_fill, speculative_fill

    model = tiny()
    template, free = _template()
    plain = greedy_fill(model, template, free, loop_counts=(4, 5), noise=StateNoise(4, [0]))
    fast, stats = speculative_fill(model, template, free, draft_loops=1, loop_counts=(4, 5),
                                   draft_tokens=draft_tokens, noise=StateNoise(4, [0]))
    assert torch.equal(fast, plain)
    assert stats.accepted < stats.drafted  # one loop disagrees somewhere
    # each round decides its accepted drafts plus one more (the last round may have none after it)
    assert 8 <= stats.rounds + stats.accepted <= 9
    same, stats = speculative_fill(model, template, free, draft_loops=(4, 5), loop_counts=(4, 5),
                                   draft_tokens=draft_tokens, noise=StateNoise(4, [0]))
    assert torch.equal(same, plain) and stats.acceptance == 1.0
    assert stats.rounds == -(-8 // (draft_tokens + 1))  # 8 free positions after the first, k+1 per round


def test_speculative_fill_with_exits_and_bad_templates():
    from rdepth.errors import RdepthError
    from rdepth.model.speculative import greedy_fill, speculative_fill

    model = tiny(block_size=16)
    template, free = _template()  # longer than the block: free positions past 16 stay as given

    def controller():
        return controller_factory("kl", 1e-3, 6, lambda: model.readout)()

    plain = greedy_fill(model, template, free, controller_factory=controller, noise=StateNoise(2, [0]))
    fast, _ = speculative_fill(model, template, free, draft_loops=1, controller_factory=controller,
                               draft_tokens=3, noise=StateNoise(2, [0]))
    assert torch.equal(fast, plain) and torch.equal(plain[0, 17:], template[0, 17:])
    with pytest.raises(RdepthError, match="first position"):
        greedy_fill(model, template, torch.ones(22, dtype=torch.bool))
    with pytest.raises(RdepthError, match="bool tensor of shape"):
        speculative_fill(model, template, free[:5], draft_loops=1)
