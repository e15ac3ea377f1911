"""A run's tokenizer as the files ``transformers.AutoTokenizer`` reads (``tokenizer.json`` + config).

Both rdepth tokenizers are byte-level BPEs, so both become one ``tokenizers`` JSON:

- ``bpe:N`` is already a ``tokenizers`` model: its JSON is written as it is;
- ``gpt2`` (tiktoken-format ``encoder.json``/``vocab.bpe``) is rebuilt as the same
  BPE with GPT-2's byte-level pre-tokenizer (ids equal, tested).

One difference is documented rather than hidden: rdepth encodes the text
``<|endoftext|>`` literally, while a Hugging Face tokenizer reads it as the special
token (its id is the model's ``eos_token_id``).

The pad token is one of its own, :data:`PAD_TEXT`, with the id ``vocab_size`` (one past the model's
vocabulary), not the end token: transformers then infers the attention mask from the pads, and its
logits processors that read the input ids (``repetition_penalty``) see pads, not end tokens. The
exported model reads the pad as the end token and gives it a logit of ``-inf`` (see
:mod:`rdepth.interop.hf_model`). Padding is on the left (what batched ``generate`` needs; the
model's ``forward`` takes either side).
"""

from __future__ import annotations

import json
from pathlib import Path

from rdepth.data.tokenizers import EOT_TEXT, BpeTokenizer, Gpt2Tokenizer
from rdepth.errors import RdepthError
from rdepth.io import write_json, write_text

PAD_TEXT = "<|pad|>"  # the exported tokenizer's pad token, id vocab_size


def tokenizer_json(tokenizer) -> str:
    """The ``tokenizers`` JSON of an rdepth tokenizer."""
    if isinstance(tokenizer, BpeTokenizer):
        return tokenizer._tokenizer.to_str()
    if isinstance(tokenizer, Gpt2Tokenizer):
        return _gpt2_json(tokenizer._bpe_files)
    raise RdepthError(f"cannot export tokenizer {getattr(tokenizer, 'name', type(tokenizer).__name__)!r}")


def _gpt2_json(files: dict[str, Path]) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = json.loads(Path(files["encoder.json"]).read_text(encoding="utf-8"))
    merges = [tuple(line.split(" ")) for line in Path(files["vocab.bpe"]).read_text(encoding="utf-8").splitlines()[1:]
              if line.strip()]
    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(EOT_TEXT, special=True)])
    return hf.to_str()


def with_pad_token(text: str, pad_id: int) -> str:
    """The ``tokenizers`` JSON ``text`` with :data:`PAD_TEXT` added as a special token of id ``pad_id`` (one
    past the model's vocabulary); a one-line error where the tokenizer already holds that text or id."""
    from tokenizers import Tokenizer

    data = json.loads(text)
    before = Tokenizer.from_str(text)
    if before.token_to_id(PAD_TEXT) is not None or before.id_to_token(pad_id) is not None:
        raise RdepthError(f"cannot add the pad token {PAD_TEXT!r} as id {pad_id}: the tokenizer already has "
                          f"{'that token' if before.token_to_id(PAD_TEXT) is not None else 'that id'}")
    data.setdefault("added_tokens", []).append({"id": pad_id, "content": PAD_TEXT, "single_word": False,
                                                "lstrip": False, "rstrip": False, "normalized": False,
                                                "special": True})
    text = json.dumps(data, ensure_ascii=False)
    if Tokenizer.from_str(text).token_to_id(PAD_TEXT) != pad_id:
        raise RdepthError(f"the tokenizer did not take the pad token {PAD_TEXT!r} as id {pad_id}")
    return text


def write_tokenizer_files(tokenizer, directory: Path, max_length: int, pad_id: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` for ``AutoTokenizer.from_pretrained(directory)``;
    the pad token :data:`PAD_TEXT` has the id ``pad_id`` (the model's ``vocab_size``)."""
    write_text(directory / "tokenizer.json", with_pad_token(tokenizer_json(tokenizer), pad_id))
    write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT_TEXT,
        "eos_token": EOT_TEXT,
        "unk_token": EOT_TEXT,
        "pad_token": PAD_TEXT,  # its own token, not the end token: the pads are told apart from real ends
        "padding_side": "left",  # batched generate() needs left padding; forward takes either side
        "model_input_names": ["input_ids", "attention_mask"],  # no token_type_ids
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    })
