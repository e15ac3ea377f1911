"""A run's tokenizer as the files ``transformers.AutoTokenizer`` reads (``tokenizer.json`` + config).

Both rdepth tokenizers are byte-level BPEs, so both become one ``tokenizers`` JSON:

- ``bpe:N`` is already a ``tokenizers`` model: its JSON is written as it is;
- ``gpt2`` (tiktoken-format ``encoder.json``/``vocab.bpe``) is rebuilt as the same
  BPE with GPT-2's byte-level pre-tokenizer (ids equal, tested).

One difference is documented rather than hidden: rdepth encodes the text
``<|endoftext|>`` literally, while a Hugging Face tokenizer reads it as the special
token (its id is the model's ``eos_token_id``). The pad token is that end token, and padding is
on the left (what batched ``generate`` needs; the model's ``forward`` takes either side).
"""

from __future__ import annotations

import json
from pathlib import Path

from rdepth.data.tokenizers import EOT_TEXT, BpeTokenizer, Gpt2Tokenizer
from rdepth.errors import RdepthError
from rdepth.io import write_json, write_text


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


def write_tokenizer_files(tokenizer, directory: Path, max_length: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` for ``AutoTokenizer.from_pretrained(directory)``."""
    write_text(directory / "tokenizer.json", tokenizer_json(tokenizer))
    write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT_TEXT,
        "eos_token": EOT_TEXT,
        "unk_token": EOT_TEXT,
        "pad_token": EOT_TEXT,  # batches pad with the end token; the attention mask marks it
        "padding_side": "left",
        "model_input_names": ["input_ids", "attention_mask"],  # no token_type_ids  # batched generate() needs left padding; forward takes either side
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    })
