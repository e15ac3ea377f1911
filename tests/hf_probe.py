"""Run an exported folder the way a transformers user would, and save what it gave (no tests here).

``python tests/hf_probe.py FOLDER OUT.pt`` runs in any environment with torch and transformers,
rdepth unimportable (``tests/test_hf_versions.py`` runs it in venvs holding older transformers
releases and compares the results with rdepth's own). It saves a dict of:

- ``version``: transformers' version;
- ``ids``: the tokenizer's ids of each prompt;
- ``logits[counts]``: forward logits of the first prompt at each loop budget;
- ``greedy[counts]``: greedy ``generate`` (rdepth's decoder) of the first prompt;
- ``hf_loop_cached`` / ``hf_loop_uncached``: greedy through transformers' own loop (with rdepth's
  cache, and re-running the whole sequence each step);
- ``left_padded``: ``generate`` of every prompt in one left-padded batch; ``pipeline``: the batched
  text-generation pipeline's texts;
- ``special``: the pad and end ids of the config, generation config and tokenizer; ``mask_warnings``:
  transformers' warnings that the attention mask cannot be inferred, from its own loop on one prompt and
  on a batch of two, neither with a mask;
- ``penalised`` / ``penalised_cached`` / ``penalised_alone``: ``repetition_penalty`` (transformers' own loop,
  uncached, and with rdepth's cache) on the
  left-padded batch and on each prompt alone: the new tokens and each step's scores;
- ``resized``: after ``resize_token_embeddings(len(tokenizer))`` (the model's V tokens and the pad, which
  becomes an ordinary token V): the logits' width, a loss on the new token, and whether the saved folder
  reloads with equal logits;
- ``too_long``: the message ``generate`` gives past the block size;
- ``hidden``: ``output_hidden_states=True``'s last hidden state (the final norm's output) at ``(3, 2, 5)``
  and the shapes of its ``loop_states``;
- ``generate_hidden[use_cache]``: ``generate(output_hidden_states=True, return_dict_in_generate=True)``'s
  last hidden state at the last position of each step (None where a step gave none);
- ``checkpointing``: the loss and adapter gradient with ``gradient_checkpointing_enable()`` and without;
- ``sdpa``: whether the folder loaded with ``attn_implementation="sdpa"`` gives the same logits;
- ``max_length``: the generation config's.
"""

from __future__ import annotations

import logging
import sys
import tempfile

import torch

PROMPTS = ["The old castle on the hill above the river", "A small village", "The north tower and the market"]
BUDGETS = ((1, 1, 1), (3, 2, 5))
NEW = 8
PENALTY = 1.5


class _Messages(logging.Handler):
    """The messages logged to transformers' loggers while attached."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _penalised(model, inputs: dict, use_cache: bool = False) -> tuple[list, list]:
    """Greedy tokens and per-step scores under ``repetition_penalty`` through transformers' own loop."""
    out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, loop_counts=[3, 2, 5], use_cache=use_cache,
                         repetition_penalty=PENALTY, return_dict_in_generate=True, output_scores=True)
    return out.sequences[:, inputs["input_ids"].shape[1]:].tolist(), [scores.clone() for scores in out.scores]


def probe(folder: str) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    out: dict = {"version": transformers.__version__, "tied": bool(model.config.tie_word_embeddings),
                 "pad_token": tokenizer.pad_token, "padding_side": tokenizer.padding_side}
    out["ids"] = [tokenizer(p).input_ids for p in PROMPTS]
    out["special"] = {"pad": getattr(model.config, "pad_token_id", None),
                      "generation_pad": model.generation_config.pad_token_id,
                      "tokenizer_pad": tokenizer.pad_token_id, "eos": model.config.eos_token_id,
                      "vocab": model.config.vocab_size, "tokenizer_length": len(tokenizer)}
    first = torch.tensor([out["ids"][0]])
    out["logits"], out["greedy"] = {}, {}
    heard = _Messages()
    logging.getLogger("transformers").addHandler(heard)
    with torch.no_grad():
        for counts in BUDGETS:
            out["logits"][counts] = model(first, loop_counts=list(counts)).logits
            out["greedy"][counts] = model.generate(first, max_new_tokens=NEW, do_sample=False,
                                                   loop_counts=list(counts)).tolist()
        # transformers' own loop: dict outputs are not rdepth's decoder's, so generate() hands them on
        looped = model.generate(first, max_new_tokens=NEW, do_sample=False, loop_counts=[3, 2, 5],
                                return_dict_in_generate=True, output_scores=True)
        out["hf_loop_cached"] = looped.sequences.tolist()
        model.generate(torch.cat([first, first]), max_new_tokens=2, do_sample=False, loop_counts=[3, 2, 5],
                       return_dict_in_generate=True, output_scores=True)  # a batch without a mask
        logging.getLogger("transformers").removeHandler(heard)
        out["mask_warnings"] = [m for m in heard.messages if "cannot be inferred" in m]
        states = model(first, loop_counts=[3, 2, 5], output_hidden_states=True)
        out["hidden"] = (states.hidden_states[-1], [tuple(s.shape) for s in states.loop_states])
        out["generate_hidden"] = {}
        for use_cache in (True, False):
            steps = model.generate(first, max_new_tokens=3, do_sample=False, loop_counts=[3, 2, 5], use_cache=use_cache,
                                   output_hidden_states=True, return_dict_in_generate=True).hidden_states
            out["generate_hidden"][use_cache] = [None if step is None else step[-1][:, -1].clone() for step in steps]
        named = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, attn_implementation="sdpa").eval()
        out["sdpa"] = bool(torch.equal(named(first, loop_counts=[3, 2, 5]).logits, out["logits"][(3, 2, 5)]))
        out["max_length"] = model.generation_config.max_length
        out["hf_loop_uncached"] = model.generate(first, max_new_tokens=NEW, do_sample=False, loop_counts=[3, 2, 5],
                                                 use_cache=False).tolist()
        batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
        out["left_padded"] = model.generate(**batch, max_new_tokens=NEW, do_sample=False,
                                            loop_counts=[3, 2, 5]).tolist()
        out["left_padded_mask"] = batch.attention_mask.tolist()
        out["padded_logits"] = model(**batch, loop_counts=[3, 2, 5]).logits
        out["penalised"] = _penalised(model, dict(batch))
        out["penalised_cached"] = _penalised(model, dict(batch), use_cache=True)  # rdepth's cache, left pads
        out["penalised_alone"] = [_penalised(model, dict(tokenizer(p, return_tensors="pt"))) for p in PROMPTS]
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
        texts = generator(PROMPTS, batch_size=3, max_new_tokens=NEW, do_sample=False, loop_counts=[3, 2, 5])
        out["pipeline"] = [t[0]["generated_text"] for t in texts]
        try:
            model.generate(first, max_new_tokens=model.config.block_size, do_sample=False)
            out["too_long"] = None
        except ValueError as error:
            out["too_long"] = str(error)
    out["checkpointing"] = []
    for enabled in (False, True):
        model.train()
        if enabled:
            model.gradient_checkpointing_enable()
        loss = model(first, labels=first, loop_counts=[3, 2, 5]).loss
        loss.backward()
        out["checkpointing"].append((float(loss.detach()), model.model.adapters[0].weight.grad.clone()))
        model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_disable()
    model.eval()
    vocab = len(tokenizer) - 1  # the model's own vocabulary: the tokenizer's pad lies one past it
    before = out["logits"][(3, 2, 5)]
    model.resize_token_embeddings(len(tokenizer))
    with torch.no_grad():
        logits = model(first, loop_counts=[3, 2, 5]).logits
    labels = first.clone()
    labels[0, -1] = vocab  # the new token
    model.train()
    loss = model(first, labels=labels, loop_counts=[3, 2, 5]).loss
    loss.backward()
    model.eval()
    with tempfile.TemporaryDirectory() as saved:
        model.save_pretrained(saved)
        again = AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=True).eval()
        with torch.no_grad():
            reloaded = again(first, loop_counts=[3, 2, 5]).logits
    out["resized"] = {"width": logits.shape[-1], "old_columns_diff": float((logits[..., :vocab] - before[..., :vocab]).abs().max()),
                      "loss": float(loss.detach()), "reloads_equal": bool(torch.equal(reloaded, logits))}
    return out


if __name__ == "__main__":
    sys.modules["rdepth"] = None  # any import of rdepth fails: the folder must stand alone
    torch.save(probe(sys.argv[1]), sys.argv[2])
