"""``rdepth export``: the folder transformers loads gives rdepth's logits and greedy tokens exactly."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from rdepth.errors import RdepthError
from rdepth.exits.controller import controller_factory
from rdepth.model.generation import generate
from rdepth.model.noise import StateNoise

transformers = pytest.importorskip("transformers")

from test_hf_helpers import cli, one_line_error, real, tiny_run, tiny_tokenizer  # noqa: E402

PROMPT = "The old castle on the hill above the river"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny three-group run with random initial states, exported; and the loaded HF model."""
    from rdepth.interop.config import ExportConfig
    from rdepth.interop.export import export_run

    root = tmp_path_factory.mktemp("export")
    run, model = tiny_run(root / "run", groups="1|2-3|4", n_layer=6)
    out = export_run(ExportConfig(checkpoint=str(run), out=str(root / "hf")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    return run, model, out, hf


def test_folder_holds_what_transformers_needs(exported):
    _, model, out, hf = exported
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_rdepth.py", "configuration_rdepth.py",
            "tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["groups"] == "1|2-3|4" and config["model_type"] == "rdepth"
    assert type(hf).__name__ == "RdepthForCausalLM" and hf.dtype == torch.float32
    for name, tensor in model.state_dict().items():  # every weight arrives under its own name
        assert torch.equal(hf.state_dict()["model." + name], tensor)


@pytest.mark.parametrize("counts", [(1, 1, 1), (3, 2, 5), (4, 4, 4)])
def test_logits_equal_rdepth(exported, counts):
    _, model, _, hf = exported
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)] * 2)
    with torch.no_grad():
        ours = model(ids, loop_counts=counts, noise=StateNoise(0, [0, 0])).logits
        theirs = real(hf(ids, loop_counts=list(counts)).logits)
        assert torch.equal(theirs, ours)
        # the seed and the per-row sequence ids are per-call settings, keyed as rdepth keys them
        ours = model(ids, loop_counts=counts, noise=StateNoise(7, [3, 9])).logits
        assert torch.equal(real(hf(ids, loop_counts=counts, state_seed=7, sequence_ids=[3, 9]).logits), ours)
        assert not torch.equal(real(hf(ids, loop_counts=counts, state_seed=8, sequence_ids=[3, 9]).logits), ours)


def test_hidden_states_and_loop_iterates_are_the_models_own(exported):
    """output_hidden_states=True: the embedding, layer 0's output, each group's hand-off, layer 5's
    output and the final norm's (which the head reads), and per group the start state and every
    iterate, computed here step by step from the model's pieces; with a cache or an exit policy a
    ValueError names what to pass."""
    _, model, _, hf = exported
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)] * 2)
    counts, noise = (3, 2, 4), StateNoise(0, [0, 0])
    with torch.no_grad():
        out = hf(ids, loop_counts=list(counts), output_hidden_states=True)
        x = model.embed(ids)
        hidden, loops = [x], []
        x = model.layers[0](x)
        hidden.append(x)
        for group, steps in enumerate(counts):
            projected = model.group_input(group, x)
            state = model.init_state(group, x, noise)
            iterates = [state]
            for _ in range(steps):
                state = model.loop_step(group, state, projected)
                iterates.append(state)
            loops.append(torch.stack(iterates))
            x = state
            hidden.append(x)
        hidden.append(model.layers[5](x))
        hidden.append(model.norm_f(hidden[-1]))
        plain = real(hf(ids, loop_counts=list(counts)).logits)
    assert len(out.hidden_states) == 7 and len(out.loop_states) == 3
    for got, want in zip(out.hidden_states, hidden, strict=False):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for got, want in zip(out.loop_states, loops, strict=False):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(real(out.logits), plain)
    assert torch.equal(model.readout(out.hidden_states[-2]), plain)  # the head reads the last one through the norm
    with torch.no_grad():  # through the cache: the same states (the dense forward of the cache's tokens)
        cached = hf(ids, loop_counts=list(counts), output_hidden_states=True, use_cache=True)
    for got, want in zip(cached.hidden_states + cached.loop_states, out.hidden_states + out.loop_states, strict=False):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="output_hidden_states needs fixed loop counts"):
        hf(ids, output_hidden_states=True, exit_policy={"name": "step_norm", "tau": 1.0, "k_max": 4})
    with pytest.raises(ValueError, match="do not return attention weights"):
        hf(ids, output_attentions=True)


def test_default_loops_come_from_the_config(exported):
    _, model, _, hf = exported
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    with torch.no_grad():
        assert torch.equal(real(hf(ids).logits), model(ids, noise=StateNoise(0, [0])).logits)  # round(mean_loops)
        hf.config.loop_counts = [2, 1, 2]
        try:
            assert torch.equal(real(hf(ids).logits), model(ids, loop_counts=(2, 1, 2), noise=StateNoise(0, [0])).logits)
        finally:
            hf.config.loop_counts = None


def test_zero_initial_state(tmp_path):
    """init_state_scale 0: no noise at all, the seed is irrelevant."""
    from rdepth.interop.config import ExportConfig
    from rdepth.interop.export import export_run

    run, model = tiny_run(tmp_path / "run", init_state_scale=0.0)
    out = export_run(ExportConfig(checkpoint=str(run), out=str(tmp_path / "hf"), loops="2,3"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    with torch.no_grad():
        expected = model(ids, loop_counts=(2, 3)).logits
        assert torch.equal(real(hf(ids).logits), expected)
        assert torch.equal(real(hf(ids, state_seed=5).logits), expected)


def test_padding_on_either_side_leaves_real_tokens_exact(exported):
    _, _, _, hf = exported
    ids = tiny_tokenizer().encode(PROMPT)
    short, pads = ids[:5], len(ids) - 5
    right = torch.tensor([ids, short + [0] * pads])
    left = torch.tensor([ids, [0] * pads + short])
    right_mask = torch.tensor([[1] * len(ids), [1] * 5 + [0] * pads])
    with torch.no_grad():
        alone = real(hf(torch.tensor([short])).logits)
        full = real(hf(torch.tensor([ids])).logits)
        # the same maths (causal attention never reads the pads); a different length rounds differently
        from_right = real(hf(right, attention_mask=right_mask).logits)
        torch.testing.assert_close(from_right[1, :5], alone[0], rtol=1e-5, atol=1e-5)
        # left pads: the row is shifted to start at position 0 (learned positions) and shifted back
        from_left = real(hf(left, attention_mask=right_mask.flip(1)).logits)
        assert torch.equal(from_left[1, pads:], from_right[1, :5]) and torch.equal(from_left[0], from_right[0])
        torch.testing.assert_close(from_left[0], full[0], rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="contiguous"):  # a gap inside a row
            hf(right, attention_mask=torch.tensor([[1] * len(ids), [1, 0] * (len(ids) // 2) + [1] * (len(ids) % 2)]))
        # the cache takes left padding (each row from its first real token, as alone), not right padding
        cached = real(hf(left, attention_mask=right_mask.flip(1), use_cache=True).logits)
        torch.testing.assert_close(cached[1, pads:], alone[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cached[0], full[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(cached[1, :pads], torch.zeros_like(cached[1, :pads]))
        with pytest.raises(ValueError, match="cache takes left padding only"):
            hf(right, attention_mask=right_mask, use_cache=True)


def test_left_padded_batch_generates_each_rows_unpadded_tokens(exported):
    _, model, out, hf = exported
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.padding_side == "left"
    prompts = [PROMPT, "A small village", "The north tower and the market"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert set(batch) == {"input_ids", "attention_mask"}
    tokens = hf.generate(**batch, max_new_tokens=12, do_sample=False, loop_counts=[2, 3, 1],
                         sequence_ids=[4, 5, 6])
    width = batch.input_ids.shape[1]
    for row, prompt, sequence in zip(tokens, prompts, (4, 5, 6), strict=False):
        ids = torch.tensor([tiny_tokenizer().encode(prompt)])
        alone = generate(model, ids, 12, temperature=0, loop_counts=(2, 3, 1), noise=StateNoise(0, [sequence]))
        assert row[width - ids.shape[1]:].tolist() == alone[0].tolist()
    with pytest.raises(ValueError, match="left-padded"):
        right = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="right")
        hf.generate(**right, max_new_tokens=4)


def test_the_pad_token_is_its_own(exported):
    """issue 43: pad = eos = bos = 0 and no pad_token_id in config.json. The pad is its own token now, one past
    the model's vocabulary, in config.json, generation_config.json and the tokenizer files."""
    _, model, out, hf = exported
    vocab = model.config.vocab_size
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert config["pad_token_id"] == generation["pad_token_id"] == tokenizer.pad_token_id == vocab
    assert config["eos_token_id"] == generation["eos_token_id"] == tokenizer.eos_token_id != vocab
    assert json.loads((out / "tokenizer_config.json").read_text())["pad_token"] == tokenizer.pad_token == "<|pad|>"
    # transformers' vocabulary (the logits' width, the tokenizer's length) counts the pad; the model's does not
    assert config["vocab_size"] == len(tokenizer) == vocab + 1 and hf.model.config.vocab_size == vocab
    assert tokenizer.decode([vocab, *tiny_tokenizer().encode("A small village")], skip_special_tokens=True) \
        == "A small village"


def test_repetition_penalty_on_a_left_padded_batch_equals_each_prompt_alone(exported):
    """``repetition_penalty`` sends generate() into transformers' own loop, whose penalty reads every input id,
    the pads included. With pad = eos the pads penalised the end token in padded rows only (issue 43); the
    export's own pad has a -inf column that the penalty leaves -inf. Every row's scores on the real vocabulary
    and its tokens are its prompt's alone."""
    _, model, out, hf = exported
    vocab = model.config.vocab_size
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    prompts = [PROMPT, "A small village", "The north tower and the market"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert (batch.input_ids == vocab).any()
    for use_cache in (False, True):  # with the cache: a decoder per group of rows of one real length
        settings = dict(max_new_tokens=8, do_sample=False, loop_counts=[3, 2, 5], repetition_penalty=1.5,
                        use_cache=use_cache, return_dict_in_generate=True, output_scores=True)
        together = hf.generate(**batch, **settings)
        width = batch.input_ids.shape[1]
        for row, prompt in enumerate(prompts):
            ids = tokenizer(prompt, return_tensors="pt")
            alone = hf.generate(**ids, **settings)
            assert together.sequences[row, width:].tolist() == alone.sequences[0, ids.input_ids.shape[1]:].tolist()
            for scores, scores_alone in zip(together.scores, alone.scores, strict=False):  # a different length rounds differently
                torch.testing.assert_close(scores[row, :vocab], scores_alone[0, :vocab], rtol=1e-5, atol=1e-5)
                assert torch.isneginf(scores[row, vocab:]).all() and torch.isneginf(scores_alone[0, vocab:]).all()


def test_labels_and_inputs_holding_the_pad(exported):
    """The pad reads as the end token (the model has no row for it) and is never a target: a right-padded row
    with its pads as labels has the loss of the row without them."""
    _, model, _, hf = exported
    vocab = model.config.vocab_size
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    padded = torch.cat([ids, torch.full((1, 4), vocab)], dim=1)
    mask = torch.cat([torch.ones_like(ids), torch.zeros(1, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        alone = hf(ids, labels=ids)
        with_pads = hf(padded, attention_mask=mask, labels=padded)
    torch.testing.assert_close(with_pads.loss, alone.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(with_pads.logits[:, :ids.shape[1]], alone.logits, rtol=1e-5, atol=1e-5)


def test_generation_past_the_block_size_is_a_clear_error(exported):
    _, model, _, hf = exported
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    room = model.config.block_size - ids.shape[1]
    assert hf.generate(ids, max_new_tokens=room, do_sample=False).shape[1] == model.config.block_size
    for options in ({}, {"output_scores": True, "return_dict_in_generate": True}):  # decoder, transformers' loop
        with pytest.raises(ValueError, match=f"block_size = {model.config.block_size}"):
            hf.generate(ids, max_new_tokens=room + 1, do_sample=False, **options)
    with pytest.raises(ValueError, match="block_size"):
        hf(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))


def test_resized_embeddings_keep_the_head_tied_and_reload(tmp_path):
    run, model = tiny_run(tmp_path / "run", groups="1|2-3", n_layer=5)
    from rdepth.interop.config import ExportConfig
    from rdepth.interop.export import export_run

    out = export_run(ExportConfig(checkpoint=str(run), out=str(tmp_path / "hf")))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    vocab = model.config.vocab_size
    with torch.no_grad():
        before = real(hf(ids).logits)
    hf.resize_token_embeddings(vocab + 1)
    with torch.no_grad():
        after = hf(ids).logits
    # the pad token (id vocab) is an ordinary token now: its column is the new row's logit, not -inf
    assert after.shape[-1] == vocab + 1 and torch.equal(after[..., :vocab], before)
    assert torch.isfinite(after).all() and hf.config.pad_token_id == vocab and not hf.config.extra_pad_token
    # the new token's embedding row is its head row: both start at the mean of the old rows
    assert torch.equal(hf.get_input_embeddings().weight[vocab], model.wte.weight[:vocab].mean(dim=0))
    labels = ids.clone()
    labels[0, -1] = vocab
    hf.train()
    loss = hf(ids, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss) and hf.get_input_embeddings().weight.grad[vocab].abs().sum() > 0
    hf.eval()
    hf.save_pretrained(tmp_path / "resized")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "resized", trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, after)
    assert again.config.vocab_size == vocab + 1


def test_greedy_generate_equals_rdepth_generate(exported):
    from rdepth.run.config import GenerateConfig
    from rdepth.run.generate_text import generate_text

    run, model, out, hf = exported
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert ids[0].tolist() == tiny_tokenizer().encode(PROMPT)
    for counts in ((1, 2, 1), (3, 3, 3)):
        theirs = hf.generate(ids, max_new_tokens=15, do_sample=False, loop_counts=list(counts))
        ours = generate(model, ids, 15, temperature=0, loop_counts=counts, noise=StateNoise.consecutive(0, 0, 1))
        assert theirs.tolist() == ours.tolist()
    # and rdepth generate's own pipeline (seed 0, one sample: the same keyed initial states)
    text = generate_text(GenerateConfig(checkpoint=str(run), prompt=PROMPT, max_new_tokens=15, temperature=0,
                                        loops="3", show_special=True, device="cpu"))[0]
    assert tokenizer.decode(hf.generate(ids, max_new_tokens=15, do_sample=False, loop_counts=3)[0]) == text


def test_cached_and_uncached_generation_agree(exported):
    _, _, _, hf = exported
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    cached = hf.generate(ids, max_new_tokens=10, do_sample=False, loop_counts=2)
    plain = hf.generate(ids, max_new_tokens=10, do_sample=False, loop_counts=2, use_cache=False)
    assert cached.tolist() == plain.tolist()


def test_training_mode_gives_a_loss_with_gradients(exported):
    _, _, _, hf = exported
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    hf.train()
    try:
        loss = hf(ids, labels=ids, loop_counts=2).loss
        loss.backward()
        assert torch.isfinite(loss) and hf.model.adapters[0].weight.grad is not None
    finally:
        hf.zero_grad(set_to_none=True)
        hf.eval()


def test_exported_code_runs_without_rdepth(exported, tmp_path):
    """The folder loads in a process where ``import rdepth`` fails, with rdepth's logits."""
    _, model, out, _ = exported
    ids = tiny_tokenizer().encode(PROMPT)
    script = textwrap.dedent(f"""
        import sys
        sys.modules["rdepth"] = None  # any import of rdepth now fails
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        assert not any(name.startswith("rdepth.") for name in sys.modules)
        with torch.no_grad():
            logits = model(torch.tensor([{ids}]), loop_counts=[2, 3, 1]).logits
        torch.save(logits, {str(tmp_path / "logits.pt")!r})
    """)
    env = {**__import__("os").environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with torch.no_grad():
        expected = model(torch.tensor([ids]), loop_counts=(2, 3, 1), noise=StateNoise(0, [0])).logits
    assert torch.equal(real(torch.load(tmp_path / "logits.pt")), expected)


def test_gpt2_tokenizer_exports_with_equal_ids(tmp_path):
    from rdepth.data.fetch import gpt2_bpe_files
    from rdepth.data.tokenizers import Gpt2Tokenizer
    from rdepth.interop.hf_tokenizer import write_tokenizer_files

    try:
        tokenizer = Gpt2Tokenizer(gpt2_bpe_files())
    except RdepthError as exc:
        pytest.skip(f"GPT-2 BPE files unavailable offline: {exc}")
    write_tokenizer_files(tokenizer, tmp_path, 1024, pad_id=50257)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    text = "Hello world! It's  3.14 \u00e9t\u00e9 \n\n  tabs\there \U0001F600 don't WORLD   "
    assert hf(text).input_ids == tokenizer.encode(text)
    assert tokenizer.encode("Hello world") == [15496, 995] and hf.eos_token_id == 50256
    assert hf.pad_token == "<|pad|>" and hf.pad_token_id == 50257 and len(hf) == 50258


def test_generated_source_is_rdepths_own(tmp_path):
    import ast
    import dataclasses

    from rdepth.config import ModelConfig
    from rdepth.interop.hf_config import RdepthConfig
    from rdepth.interop.source import MODELING_PARTS, Part, modeling_source, module_path

    text = modeling_source()
    assert text == modeling_source()  # deterministic
    tree = ast.parse(text)
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("rdepth")]
    # every bundled class and function is there verbatim
    for part in MODELING_PARTS:
        source = module_path(part.module).read_text()
        for node in ast.parse(source).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and (part.only is None or node.name in part.only):
                segment = ast.get_source_segment(source, node)  # less its lazy rdepth imports
                segment = "\n".join(line for line in segment.splitlines() if not line.strip().startswith("from rdepth"))
                assert segment in text, (part.module, node.name)
    # the HF config mirrors ModelConfig field for field, with the same defaults
    fields = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    defaults = RdepthConfig()
    for name, default in fields.items():
        assert getattr(defaults, name) == default, name
    with pytest.raises(RdepthError, match="also defined"):
        modeling_source((Part("rdepth.errors"), Part("rdepth.errors")))
    with pytest.raises(RdepthError, match="no bundled module defines"):
        modeling_source((Part("rdepth.model.layers"),))


def test_help(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(monkeypatch, "export", "--help")
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--checkpoint" in text and "--out" in text and "--loops" in text and "--state-seed" in text


def test_cli_export_and_bad_input(tmp_path, monkeypatch, capsys):
    run, _ = tiny_run(tmp_path / "run")
    assert cli(monkeypatch, "export", "--checkpoint", run, "--out", tmp_path / "hf", "--loops", "2,1") == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["loop_counts"] == [2, 1]
    empty = tmp_path / "empty"
    empty.mkdir()  # an existing empty folder is fine
    assert cli(monkeypatch, "export", "--checkpoint", run / "checkpoints", "--out", empty) == 0
    assert (empty / "model.safetensors").is_file()
    capsys.readouterr()

    err = one_line_error(capsys, cli(monkeypatch, "export", "--checkpoint", tmp_path / "hf", "--out", tmp_path / "x"))
    assert "not an rdepth run" in err and not (tmp_path / "x").exists()
    err = one_line_error(capsys, cli(monkeypatch, "export", "--checkpoint", tmp_path / "nope", "--out", tmp_path / "x"))
    assert "not found" in err
    before = (tmp_path / "hf" / "config.json").read_bytes()
    err = one_line_error(capsys, cli(monkeypatch, "export", "--checkpoint", run, "--out", tmp_path / "hf"))
    assert "not empty" in err and (tmp_path / "hf" / "config.json").read_bytes() == before
    err = one_line_error(capsys, cli(monkeypatch, "export", "--checkpoint", run, "--out", tmp_path / "y",
                                     "--loops", "1,2,3"))
    assert "loop counts" in err and not (tmp_path / "y").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind


# thresholds at which this random model's tokens exit at different steps
EXIT_RULES = [
    {"name": "acceleration", "tau": 5.0, "k_max": 6},
    {"name": "step_norm", "tau": 5.0, "k_max": 6},
    {"name": "kl", "tau": 0.1, "k_max": [6, 5, 6]},  # reads the predictive distribution through the head
    {"name": "argmax_stable", "patience": 2, "k_max": 5},
]


@pytest.mark.parametrize("rule", EXIT_RULES, ids=lambda rule: rule["name"])
def test_exit_policies_match_rdepths_controller(exported, rule):

    _, model, _, hf = exported
    options = dict(rule)
    name, k_max = options.pop("name"), options.pop("k_max")
    k_max = tuple(k_max) if isinstance(k_max, list) else k_max

    def controller():
        return controller_factory(name, None, k_max, lambda: model.readout, options)()

    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    with torch.no_grad():
        ours = model(ids, noise=StateNoise(0, [0]), controller=controller())
        theirs = hf(ids, exit_policy=rule)
        # The same exits; the logits to float32 rounding (the two paths gather rows in another order,
        # which changes the last bits on some CPUs' kernels; fixed budgets stay bit-equal above).
        torch.testing.assert_close(real(theirs.logits), ours.logits, rtol=0, atol=1e-5)
        assert all(bool((c < c.max()).any()) for c in ours.computed) or name == "argmax_stable"  # exits differ
    tokens = generate(model, ids, 10, temperature=0, controller_factory=controller,
                      noise=StateNoise.consecutive(0, 0, 1))
    assert hf.generate(ids, max_new_tokens=10, do_sample=False, exit_policy=rule).tolist() == tokens.tolist()


def test_the_learned_exit_gate_travels_with_the_export(tmp_path, monkeypatch, capsys):
    """``rdepth export --exit-policy learned`` writes the run's trained gate beside the weights; the exported
    model's exits, logits and greedy tokens are rdepth's under the same gate (issue 38 item 3); a run
    without a gate is a one-line error and writes nothing."""
    from rdepth.exitrun.gate_file import load_gate, save_gate
    from rdepth.exits.gate import random_gate

    run, model = tiny_run(tmp_path / "run")
    err = one_line_error(capsys, cli(monkeypatch, "export", "--checkpoint", run, "--out", tmp_path / "none",
                                     "--exit-policy", "learned", "--exit-tau", "0.5", "--exit-k-max", "6"))
    assert "has no trained exit gate" in err and not (tmp_path / "none").exists()
    save_gate(random_gate(model.n_groups, model.config.d_model, seed=3, scale=4.0), run)
    assert cli(monkeypatch, "export", "--checkpoint", run, "--out", tmp_path / "hf", "--exit-policy", "learned",
               "--exit-tau", "0.5", "--exit-k-max", "6") == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["exit_policy"] == {"name": "learned", "k_max": 6, "tau": 0.5, "gate": "exit_gate.safetensors"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    gate = load_gate(run)

    def controller():
        return controller_factory("learned", 0.5, 6, None, {"gate": gate})()

    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    with torch.no_grad():
        ours = model(ids, noise=StateNoise(0, [0]), controller=controller())
        theirs = hf(ids)
    torch.testing.assert_close(real(theirs.logits), ours.logits, rtol=0, atol=1e-5)
    steps = torch.cat([c.flatten() for c in ours.computed])
    assert steps.min() < steps.max()  # the gate stops tokens at different steps: the test sees the gate
    tokens = generate(model, ids, 8, temperature=0, controller_factory=controller, noise=StateNoise.consecutive(0, 0, 1))
    assert hf.generate(ids, max_new_tokens=8, do_sample=False).tolist() == tokens.tolist()


def test_exit_policy_from_the_export_flags(tmp_path, monkeypatch, capsys):

    run, model = tiny_run(tmp_path / "run")
    assert cli(monkeypatch, "export", "--checkpoint", run, "--out", tmp_path / "hf", "--exit-policy",
               "step_norm", "--exit-tau", "5", "--exit-k-max", "4,6") == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["exit_policy"] == {"name": "step_norm", "k_max": [4, 6], "tau": 5.0}
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    with torch.no_grad():
        controller = controller_factory("step_norm", 5.0, (4, 6), lambda: model.readout)()
        assert torch.equal(real(hf(ids).logits), model(ids, noise=StateNoise(0, [0]), controller=controller).logits)
        # turned off for one call: fixed counts again
        assert torch.equal(real(hf(ids, exit_policy=False, loop_counts=2).logits),
                           model(ids, loop_counts=2, noise=StateNoise(0, [0])).logits)
    capsys.readouterr()
    for flags, message in ((["--exit-policy", "nope"], "unknown exit policy"),
                           (["--exit-policy", "acceleration", "--exit-tau", "-1"], "tau"),
                           (["--exit-policy", "acceleration", "--exit-tau", "0.1", "--exit-k-max", "1,2,3"],
                            "3 values for 2"),
                           (["--exit-tau", "0.1"], "needs --exit-policy")):
        err = one_line_error(capsys, cli(monkeypatch, "export", "--checkpoint", run, "--out", tmp_path / "bad",
                                         *flags))
        assert message in err and not (tmp_path / "bad").exists()


def test_gpt2_block_model_exports_exactly(tmp_path):
    """A looped model of GPT-2 blocks (an imported GPT-2, retrofitted) exports with equal logits."""
    from rdepth.interop.config import ExportConfig
    from rdepth.interop.export import export_run
    from rdepth.run.checkpoint import save_checkpoint

    run, model = tiny_run(tmp_path / "run", groups="1-2", n_layer=4, block="gpt2", norm_eps=1e-5)
    with torch.no_grad():  # biases and gains start at 0 and 1: make them matter
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    save_checkpoint(run, 7, model, model.config)
    out = export_run(ExportConfig(checkpoint=str(run), out=str(tmp_path / "hf")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert json.loads((out / "config.json").read_text())["block"] == "gpt2"
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    with torch.no_grad():
        for counts in ((1,), (3,)):
            ours = model(ids, loop_counts=counts, noise=StateNoise(0, [0])).logits
            assert torch.equal(real(hf(ids, loop_counts=list(counts)).logits), ours)


def test_residual_loop_state_exports_exactly(tmp_path):
    """The loop-state option travels with the export: config.json names it, the bundled code steps the
    residual stream, and the logits (fixed budgets, cached and uncached generation) equal rdepth's."""
    from rdepth.interop.config import ExportConfig
    from rdepth.interop.export import export_run

    run, model = tiny_run(tmp_path / "run", groups="1|2-3", n_layer=5, loop_state="residual")
    out = export_run(ExportConfig(checkpoint=str(run), out=str(tmp_path / "hf")))
    assert json.loads((out / "config.json").read_text())["loop_state"] == "residual"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    with torch.no_grad():
        for counts in ((1, 1), (3, 5)):
            ours = model(ids, loop_counts=counts, noise=StateNoise(0, [0])).logits
            assert torch.equal(real(hf(ids, loop_counts=list(counts)).logits), ours)
        sandwich = model.config.replace(loop_state="sandwich")
        from rdepth.model import RecurrentLM

        other = RecurrentLM(sandwich).eval()
        other.load_state_dict(model.state_dict())  # same weights, the other loop: other logits
        assert not torch.equal(other(ids, loop_counts=(3, 5), noise=StateNoise(0, [0])).logits,
                               model(ids, loop_counts=(3, 5), noise=StateNoise(0, [0])).logits)
        cached = hf.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)
        uncached = hf.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_model_card_has_front_matter_training_record_and_version_range(tmp_path):
    from rdepth.interop.config import ExportConfig
    from rdepth.interop.export import export_run
    from rdepth.interop.hf_config import TESTED_RANGE
    from rdepth.run.checkpoint import write_run_config

    run, model = tiny_run(tmp_path / "run", groups="1|2-3", n_layer=5)
    write_run_config(run, model.config, {"data": "data/wiki-bpe4096", "seed": 3, "lr": 0.002, "batch_size": 16},
                     data={"tokenizer": "bpe:320", "splits_sha256": {"train": "ab" * 32, "val": "cd" * 32}},
                     preset="tiny")
    checkpoint = next((run / "checkpoints").glob("step_*"))
    (checkpoint / "state.json").write_text(json.dumps({"step": 7, "tokens_seen": 57344}))
    out = export_run(ExportConfig(checkpoint=str(run), out=str(tmp_path / "hf"), loops="3,2", license="apache-2.0"))
    card = (out / "README.md").read_text()
    front = card.split("---")[1]
    assert "library_name: transformers" in front and "pipeline_tag: text-generation" in front
    assert "license: apache-2.0" in front
    for text in ("`data/wiki-bpe4096`", "tokenizer `bpe:320`", "Steps: 7", "Tokens seen: 57,344", "Preset: `tiny`",
                 "`1|2-3`", "`[3, 2]`", TESTED_RANGE, f'from_pretrained("{out}"', "block size) 64 tokens"):
        assert text in card, text
    assert "path/to" not in card
    # a run with no training record says so
    bare, _ = tiny_run(tmp_path / "bare")
    card = (export_run(ExportConfig(checkpoint=str(bare), out=str(tmp_path / "hf2"))).joinpath("README.md")).read_text()
    assert "Not recorded" in card and "license: other\nlicense_name: unspecified" in card and "not given at export" in card
    with pytest.raises(RdepthError, match="--license"):
        ExportConfig(checkpoint=str(bare), out=str(tmp_path / "hf3"), license="apache 2.0")


class _StopAfter:
    """A stateful per-row stopping criterion: row r is done once it holds ``counts[r]`` new tokens; it
    records each call's length (transformers calls criteria once per new token, in order)."""

    def __init__(self, width, counts):
        self.width, self.counts, self.calls = width, counts, []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append(input_ids.shape[1])
        new = input_ids.shape[1] - self.width
        return torch.tensor([new >= count for count in self.counts])


@pytest.mark.parametrize("eos", [None, "set"])
def test_stopping_criteria_through_the_decoder_equal_transformers_loop(exported, eos):
    """lm-eval's hf model passes stopping_criteria on left-padded batches: they used to send generate into
    transformers' own loop, whose cached path refuses padding (issue 43). The decoder route now applies them
    as that loop does (per token, in order; with an end token, done rows continue with padding)."""
    _, _, out, hf = exported
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompts = [PROMPT, "A small village", "The north tower and the market"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    width = batch.input_ids.shape[1]
    settings = dict(max_new_tokens=10, do_sample=False, loop_counts=2)
    if eos == "set":
        first = hf.generate(**batch, **settings)
        settings.update(eos_token_id=int(first[1, width + 1]), pad_token_id=7)  # row 1 ends at its 2nd token
    ours_stop, theirs_stop = _StopAfter(width, [3, 6, 4]), _StopAfter(width, [3, 6, 4])
    ours = hf.generate(**batch, **settings,
                       stopping_criteria=transformers.StoppingCriteriaList([ours_stop]))
    theirs = hf.generate(**batch, **settings, use_cache=False,
                         stopping_criteria=transformers.StoppingCriteriaList([theirs_stop]))
    assert ours.tolist() == theirs.tolist()
    last = 4 if eos == "set" else 6  # with the end token, row 1 is done after its 2nd token, not its 6th
    assert ours.shape[1] == width + last and ours_stop.calls == list(range(width + 1, width + last + 1))
    if eos == "set":
        assert ours[1, width + 2:].tolist() == [7] * (last - 2)


def test_beam_search_with_the_cache_is_a_clear_refusal(exported):
    """The cache cannot reorder rows: a ValueError naming use_cache=False (it failed inside transformers
    with an AttributeError or a message about caches), and beam search without the cache runs."""
    _, _, _, hf = exported
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    with pytest.raises(ValueError, match="use_cache=False"):
        hf.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False)
    beams = hf.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False, use_cache=False)
    assert beams.shape == (1, ids.shape[1] + 3)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_returns_hidden_states_per_step(exported, use_cache):
    """Issue 55: ``generate(output_hidden_states=True, return_dict_in_generate=True)`` gave None per step on
    transformers 4.57 and 5.x (prepare_inputs_for_generation dropped the flag). Each step's last hidden
    state is the dense forward's of the sequence so far, on a left-padded batch, with the cache or without."""
    _, _, out, hf = exported
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = tokenizer([PROMPT, "A small village"], return_tensors="pt", padding=True)
    width, new = batch.input_ids.shape[1], 4
    result = hf.generate(**batch, max_new_tokens=new, do_sample=False, loop_counts=2, output_hidden_states=True,
                         return_dict_in_generate=True, use_cache=use_cache)
    assert len(result.hidden_states) == new and all(step is not None for step in result.hidden_states)
    assert result.hidden_states[0][-1].shape[1] == width
    sequences = result.sequences
    assert sequences.tolist() == hf.generate(**batch, max_new_tokens=new, do_sample=False, loop_counts=2).tolist()
    for step in range(new):
        length = width + step
        mask = torch.cat([batch.attention_mask, torch.ones(2, step, dtype=torch.long)], dim=1)
        with torch.no_grad():
            dense = hf(sequences[:, :length], attention_mask=mask, loop_counts=2, output_hidden_states=True)
        real_rows = mask[:, -1].bool()
        torch.testing.assert_close(result.hidden_states[step][-1][real_rows, -1], dense.hidden_states[-1][real_rows, -1],
                                   rtol=0, atol=1e-5)


def test_gradient_checkpointing_recomputes_every_layer_application_with_the_same_gradients(exported):
    """Issue 55: ``gradient_checkpointing_enable()`` (what ``TrainingArguments(gradient_checkpointing=True)``
    calls) was refused. Each layer application of the dense forward, every loop step included, is
    recomputed in the backward; the loss and gradients equal those without it."""
    _, _, _, hf = exported
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])

    def loss_and_grads():
        hf.zero_grad(set_to_none=True)
        loss = hf(ids, labels=ids, loop_counts=2).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in hf.named_parameters() if p.grad is not None}

    calls = []

    def counting(function, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        def counted(*inner, **inner_kwargs):
            calls.append(1)
            return function(*inner, **inner_kwargs)
        return checkpoint(counted, *args, use_reentrant=False, **kwargs)

    hf.train()
    try:
        plain_loss, plain = loss_and_grads()
        enable = getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable
        enable()
        assert hf.gradient_checkpointing and all("forward" in layer.__dict__ for layer in hf.model.layers)
        loss, grads = loss_and_grads()
        assert torch.equal(loss, plain_loss) and grads.keys() == plain.keys()
        for name in plain:
            torch.testing.assert_close(grads[name], plain[name], rtol=0, atol=1e-6)
        hf._set_gradient_checkpointing(True, counting)
        loss_and_grads()
        # groups 1|2-3|4 of 6 layers at 2 steps: 1 + 2 + 2 * 2 + 2 + 1 = 10 applications, each run twice
        assert len(calls) == 2 * 10
        disable = getattr(hf, "activation_checkpointing_disable", None) or hf.gradient_checkpointing_disable
        disable()
        assert not any("forward" in layer.__dict__ for layer in hf.model.layers) and not hf.gradient_checkpointing
    finally:
        hf._set_gradient_checkpointing(False)
        hf.zero_grad(set_to_none=True)
        hf.eval()


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_attn_implementation_named_loads_the_same_model(exported, implementation):
    """Issue 55: ``attn_implementation="sdpa"`` was refused when named; every attention is torch's SDPA."""
    _, _, out, hf = exported
    named = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                                              attn_implementation=implementation).eval()
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    with torch.no_grad():
        assert torch.equal(named(ids).logits, hf(ids).logits)


def test_generate_with_no_length_runs_to_the_block_size(exported):
    """Issue 55: generation_config.json had no max_length, so generate() made transformers' 20 positions."""
    _, model, out, hf = exported
    assert json.loads((out / "generation_config.json").read_text())["max_length"] == model.config.block_size
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    produced = hf.generate(ids, loop_counts=1)
    assert produced.shape[1] == model.config.block_size or int(produced[0, -1]) == hf.generation_config.eos_token_id


def _card_checks(out, hf, model):
    """One check per statement of the model card (rdepth.interop.model_card.CLAIMS), on the exported model."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tiny_tokenizer().encode(PROMPT)])
    block = model.config.block_size

    def padded_batches():
        prompts = [PROMPT, "A small village"]
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        settings = dict(max_new_tokens=3, do_sample=False, loop_counts=2, repetition_penalty=1.3)
        together = hf.generate(**batch, **settings)
        for row, prompt in enumerate(prompts):
            alone = hf.generate(**tokenizer([prompt], return_tensors="pt"), **settings)
            assert together[row, -3:].tolist() == alone[0, -3:].tolist()

    def beam_search():
        assert hf.generate(ids, max_new_tokens=2, num_beams=2, do_sample=False, use_cache=False).shape[1] == \
            ids.shape[1] + 2
        with pytest.raises(ValueError, match="use_cache=False"):
            hf.generate(ids, max_new_tokens=2, num_beams=2, do_sample=False)

    def hidden_states():
        for use_cache in (True, False):
            got = hf.generate(ids, max_new_tokens=2, do_sample=False, output_hidden_states=True,
                              return_dict_in_generate=True, use_cache=use_cache)
            assert all(step is not None for step in got.hidden_states)
        with pytest.raises(ValueError, match="fixed loop counts"):
            hf(ids, output_hidden_states=True, exit_policy={"name": "step_norm", "tau": 1.0, "k_max": 4})

    def training():
        assert hf.supports_gradient_checkpointing and hf._supports_sdpa
        hf.train()
        try:
            hf._set_gradient_checkpointing(True)
            hf(ids, labels=ids, loop_counts=2).loss.backward()
            assert hf.model.adapters[0].weight.grad is not None
        finally:
            hf._set_gradient_checkpointing(False)
            hf.zero_grad(set_to_none=True)
            hf.eval()

    def length():
        with pytest.raises(ValueError, match="block_size"):
            hf(torch.zeros(1, block + 1, dtype=torch.long))
        assert hf.generation_config.max_length == block

    def cache_padding():
        batch = tokenizer([PROMPT, "A small village"], return_tensors="pt", padding=True, padding_side="right")
        with pytest.raises(ValueError, match="left padding only"):
            hf(**batch, use_cache=True)

    def no_embeds_or_attentions():
        with pytest.raises(ValueError, match="inputs_embeds"):
            hf(inputs_embeds=torch.zeros(1, 3, model.config.d_model))
        with pytest.raises(ValueError, match="attention weights"):
            hf(ids, output_attentions=True)

    def pad_token():
        assert hf.config.pad_token_id == model.config.vocab_size == tokenizer.pad_token_id
        with torch.no_grad():
            assert torch.isneginf(hf(ids).logits[..., hf.config.pad_token_id]).all()

    def serving():
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "rdepth" and "AutoModelForCausalLM" in config["auto_map"]

    def chat_template():
        assert getattr(tokenizer, "chat_template", None) is None

    return {check.__name__: check for check in (padded_batches, beam_search, hidden_states, training, length,
                                                cache_padding, no_embeds_or_attentions, pad_token, serving,
                                                chat_template)}


def test_every_statement_of_the_model_card_holds(exported):
    """Issue 55: the card said padded batches through transformers' loop need equal lengths and that there is
    no beam search, after both had come to work. Every statement it makes now has a check here: one that no
    longer holds fails, and so does a statement added without a check."""
    from rdepth.interop.model_card import CLAIMS

    _, model, out, hf = exported
    card = " ".join((out / "README.md").read_text().split())
    checks = _card_checks(out, hf, model)
    assert {key for key, _, _ in CLAIMS} == set(checks)
    for key, _, text in CLAIMS:
        assert text.split("{")[0].strip() in card, key
        checks[key]()
    assert "equal length" not in card and "No beam search" not in card
