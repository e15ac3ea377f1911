"""The README.md (Hugging Face model card) of an exported folder.

Front matter the Hub reads (``library_name``, ``pipeline_tag``, ``license``, ``tags``), then what the
run recorded: its training data (``RUN/config.json``: data folder, tokenizer, shard digests), steps
and tokens seen (the checkpoint's ``state.json``), the architecture and its loop counts, how to load
the folder, the supported ``transformers`` range, what works and the limits. A run that recorded no
training (an ``import-hf`` or ``retrofit`` run at step 0) says so rather than guessing.

What the card states about the exported model's behaviour is :data:`CLAIMS`, one entry per statement with
a key; ``tests/test_hf_export.py`` checks every key against a freshly exported model (a statement that no
longer holds, or one added without a check, fails there), and the card renders them with the export's
own facts (block size, positions, pad id, licence).
"""

from __future__ import annotations

import json
from pathlib import Path

from rdepth.interop.hf_config import TESTED_RANGE


def _training_lines(run: dict, state: dict) -> list[str]:
    train = run.get("train") or {}
    data = run.get("data") or {}
    lines = []
    if train.get("data"):
        lines.append(f"- Data: `{train['data']}` (prepared token shards; tokenizer `{data.get('tokenizer', '?')}`)")
        digests = data.get("splits_sha256") or {}
        if digests:
            lines.append("- Shard digests (sha256): " + ", ".join(f"{k} `{v[:16]}`" for k, v in sorted(digests.items())))
    if run.get("preset"):
        lines.append(f"- Preset: `{run['preset']}`")
    step = state.get("step")
    if step is not None:
        lines.append(f"- Steps: {step:,}")
    if state.get("tokens_seen"):
        lines.append(f"- Tokens seen: {int(state['tokens_seen']):,}")
    for name, label in (("seed", "Seed"), ("lr", "Peak learning rate"), ("batch_size", "Batch size (sequences)")):
        if train.get(name) is not None:
            lines.append(f"- {label}: {train[name]}")
    if not train:
        lines.append("- Not recorded: this checkpoint's run holds no training record (e.g. an `rdepth import-hf` "
                     "or `rdepth retrofit` run that was not trained further).")
    return lines


# (key, section, text): what the card says the exported model does and does not do. Each key has a check
# in tests/test_hf_export.py (test_every_statement_of_the_model_card_holds). The text's {fields} are the
# export's facts (see model_card).
CLAIMS: tuple[tuple[str, str, str], ...] = (
    ("padded_batches", "works",
     "Padded batches: `forward` takes left or right padding (rows are shifted to start at position 0, so a "
     "padded row's logits are its unpadded ones); `generate` takes left-padded prompts, through rdepth's decoder "
     "(greedy, temperature/top-k sampling) and through transformers' own loop with the cache (`top_p`, "
     "`repetition_penalty`, logits processors, streamers, dict outputs): each row's tokens are its unpadded "
     "generation's."),
    ("beam_search", "works",
     "Beam search with `use_cache=False` (rdepth's cache does not reorder rows: `num_beams > 1` with the "
     "cache is refused with a message naming `use_cache=False`)."),
    ("hidden_states", "works",
     "`output_hidden_states=True` in `forward` and in `generate(..., return_dict_in_generate=True)`, with or "
     "without the cache: the embedding, each layer's output and each group's hand-off, the final norm's output; "
     "`loop_states` adds every loop iterate (fixed loop counts; refused with an exit policy)."),
    ("training", "works",
     "Training: `labels` give the mean cross-entropy; `gradient_checkpointing_enable()` (or "
     "`TrainingArguments(gradient_checkpointing=True)`) recomputes each layer application, every loop step "
     "included, in the backward; `attn_implementation` `sdpa` or `eager` (the attention is torch's "
     "`scaled_dot_product_attention` either way)."),
    ("length", "limits",
     "A sequence (prompt + new tokens) of at most {block_size} tokens: {positions}, and longer input is refused "
     "with a message (no sliding window). `generate()` with no length runs to {block_size} positions "
     "(`max_length` in generation_config.json)."),
    ("cache_padding", "limits",
     "rdepth's key/value cache takes left padding only: a right-padded batch with `use_cache=True` is refused "
     "(pad on the left, or pass `use_cache=False`)."),
    ("no_embeds_or_attentions", "limits",
     "`inputs_embeds` are not taken, and attention weights are not returned (`output_attentions=True` is refused)."),
    ("pad_token", "limits",
     "The pad token `<|pad|>` is its own (`pad_token_id` {pad_id} = the model's vocabulary size, which "
     "`vocab_size` counts): the model reads it as the end token and its logit is always `-inf` (never generated; "
     "softmax over the other tokens unchanged); a label equal to it is ignored."),
    ("serving", "limits",
     "Serving engines (vLLM, TGI, llama.cpp, ...) do not run this model: its `model_type` `rdepth` and its loop "
     "are this folder's own code (`trust_remote_code=True`). Serve it with transformers, or with `rdepth serve` "
     "after `rdepth import-hf`."),
    ("chat_template", "limits",
     "No chat template: a base model trained on plain text; the tokenizer has no `chat_template`, so "
     "`apply_chat_template` does not apply."),
)


def claims_text(section: str, facts: dict) -> str:
    """The bullet list of :data:`CLAIMS` in ``section`` ("works" or "limits") with the export's ``facts``."""
    return "\n".join("- " + text.format(**facts) for _, where, text in CLAIMS if where == section)


def model_card(*, checkpoint: Path, out: str, model_config, loops, state_seed: int, exit_policy: dict | None,
               license: str, parameters: int) -> str:
    """The text of README.md for the folder ``out`` exported from ``checkpoint``."""
    from rdepth.run.checkpoint import read_run_config

    run_dir = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint
    run = read_run_config(run_dir) if (run_dir / "config.json").exists() and run_dir != checkpoint else {}
    state_path = checkpoint / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    config = model_config
    loops = list(loops)
    front = "\n".join([
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        f"license: {license}",
        *(["license_name: unspecified"] if license == "other" else []),  # the Hub asks one of "other"
        "tags:",
        "- rdepth",
        "- recurrent-depth",
        "- looped-transformer",
        "---",
    ])
    groups = config.groups or "none (a plain transformer)"
    positions = ("the positions are learned" if config.positions == "learned"
                 else "rotary positions, kept to the block size the model was trained with")
    start = ("- The loop starts from the token embedding and each step ends with the final norm (`loop_state: "
             "looplm`, Ouro's LoopLM): no random state." if config.loop_state == "looplm" else
             f"""- The initial loop state is random but deterministic: keyed by (`state_seed`, sequence id, group) and
  the token's position; `state_seed` (default {state_seed}) and `sequence_ids` are per-call arguments.
  `init_state_scale: 0` in config.json gives a zero state instead.""")
    facts = {"block_size": config.block_size, "positions": positions, "pad_id": config.vocab_size}
    licence = (f"`{license}` (the card's front matter)" if license != "other" else
               "not given at export (`rdepth export --license ID` sets it); the terms of the data and code the "
               "weights came from apply")
    body = f"""
# rdepth recurrent-depth model

Exported by `rdepth export` from `{checkpoint}`.

## Model

- {config.n_layer} layers ({config.block} blocks), d_model {config.d_model}, {config.n_head} heads,
  context (block size) {config.block_size} tokens, vocabulary {config.vocab_size}, {parameters:,} parameters.
- Recurrence groups (0-based layers, `a-b` inclusive): `{groups}`. Each group runs `loop_counts` steps
  per token; trained with a random count per step (lognormal-Poisson, mean {config.mean_loops}, gradients
  through the last {config.backprop_depth} steps).
- Default loop counts of this export: `{loops}` (per group); pass `loop_counts=N`, `[N, N, ...]` or
  `"N:N:..."` to `forward`/`generate`, or set `loop_counts` in config.json.
{start}
- Per-token early exit: `exit_policy` (default {json.dumps(exit_policy)}), in config.json or per call,
  e.g. `model.generate(ids, exit_policy={{"name": "acceleration", "tau": 1e-3, "k_max": 12}})`.

## Training

{chr(10).join(_training_lines(run, state))}

## How to load

Needs torch and {TESTED_RANGE}. The code is in this folder
(`trust_remote_code=True`); rdepth itself is not needed. An older transformers stops at import with a message naming the range.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{out}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{out}", trust_remote_code=True)
ids = tokenizer("The", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=20, do_sample=False, loop_counts={loops})
print(tokenizer.decode(out[0]))

# a batch: the tokenizer pads on the left with its own pad token (<|pad|>, not the end token)
batch = tokenizer(["The", "A longer prompt"], return_tensors="pt", padding=True)
out = model.generate(**batch, max_new_tokens=20, do_sample=False)
```

(After uploading this folder to the Hub, use its repository id in place of the path.)

## What works

{claims_text("works", facts)}

## Limits

{claims_text("limits", facts)}
- The head is the token embedding (`tie_word_embeddings: true`); `resize_token_embeddings` resizes both.
- `modeling_rdepth.py` is generated from rdepth's own source; do not edit it.

## Licence

{licence}.
"""
    return front + "\n" + body
