"""``prepare``: corpus -> tokenizer -> train/val token shards + manifest, deterministically.

The split is by document: a permutation of the document indices drawn from
``numpy.random.default_rng(seed)`` sends the first ``round(n * val_fraction)``
documents (at least one, and never all) to ``val``; each split keeps corpus
order. A trained tokenizer (``bpe:N``) sees only the training documents.

The manifest also stores the validation unigram baseline: the cross-entropy of
the val tokens under the add-one-smoothed unigram distribution of the train
tokens, the floor any language model must beat.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from rdepth.data.corpora import CORPORA, load_corpus
from rdepth.data.shards import ShardWriter, check_output_folder
from rdepth.data.tokenizers import Tokenizer, build_tokenizer, parse_tokenizer_spec
from rdepth.errors import RdepthError
from rdepth.fields import option
from rdepth.io import environment_info

log = logging.getLogger(__name__)

ENCODE_CHUNK = 256  # documents per encode_batch call


@dataclass
class PrepareConfig:
    """What ``prepare`` builds. ``out`` defaults to ``data/<corpus>-<tokenizer>`` (the folder
    ``rdepth train`` and the demo read by default)."""

    corpus: str = option("wiki", "wiki, shakespeare, or a .txt/.md/.jsonl file or folder")
    tokenizer: str = option("bpe:4096", "gpt2 (the exact GPT-2 BPE) or bpe:N (a byte-level BPE trained on the corpus)")
    out: Path | None = option(None, "output folder", default_text="data/<corpus>-<tokenizer>, e.g. data/wiki-bpe4096")
    val_fraction: float = option(0.05, "share of documents held out for validation, in (0, 1)")
    seed: int = option(0, "seed of the train/val split")
    max_documents: int | None = option(None, "keep only the first N documents (quick runs)", default_text="all")
    cache_dir: Path | None = option(None, "download cache", default_text="$RDEPTH_CACHE or ~/.cache/rdepth/wheels")

    def __post_init__(self) -> None:
        if not isinstance(self.corpus, str) or not self.corpus.strip():
            raise RdepthError("corpus: must be a corpus name or a path")
        if not isinstance(self.tokenizer, str):
            raise RdepthError("tokenizer: must be a string such as gpt2 or bpe:4096")
        parse_tokenizer_spec(self.tokenizer)
        if isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, (int, float)) \
                or not 0.0 < self.val_fraction < 1.0:
            raise RdepthError(f"val_fraction: must be in (0, 1), got {self.val_fraction!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise RdepthError(f"seed: must be a non-negative integer, got {self.seed!r}")
        if self.max_documents is not None and (
            isinstance(self.max_documents, bool) or not isinstance(self.max_documents, int)
            or self.max_documents < 2
        ):
            raise RdepthError(f"max_documents: must be an integer >= 2, got {self.max_documents!r}")
        if self.out is None:
            name = self.corpus if self.corpus in CORPORA else Path(self.corpus).stem
            self.out = default_data_folder(name or "corpus", self.tokenizer)
        self.out = Path(self.out).expanduser()
        if self.cache_dir is not None:
            self.cache_dir = Path(self.cache_dir).expanduser()


def default_data_folder(corpus_name: str, tokenizer: str) -> Path:
    """``data/wiki-bpe4096`` for corpus ``wiki`` and tokenizer ``bpe:4096``."""
    return Path("data") / f"{corpus_name}-{tokenizer.replace(':', '')}"


def split_documents(n_documents: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train_indices, val_indices), each sorted, disjoint, covering range(n_documents)."""
    if n_documents < 2:
        raise RdepthError(f"need at least 2 documents to split into train and val, got {n_documents}")
    n_val = min(n_documents - 1, max(1, round(n_documents * val_fraction)))
    order = np.random.default_rng(seed).permutation(n_documents)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


UNIGRAM_FILE = "unigram.npy"  # float64 [vocab_size]: the train split's smoothed unigram log-probabilities


def unigram_log_probs(train_tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """log p(v) = log((count_train(v) + 1) / (n_train + vocab_size)): float64 ``[vocab_size]``."""
    train_counts = np.bincount(np.asarray(train_tokens), minlength=vocab_size).astype(np.float64)
    if train_counts.size > vocab_size:
        raise ValueError(f"token id >= vocab_size {vocab_size}")
    return np.log(train_counts + 1.0) - math.log(train_counts.sum() + vocab_size)


def unigram_baseline(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int) -> dict:
    """Val cross-entropy (nats/token) and perplexity under add-one-smoothed train unigrams.

    p(v) = (count_train(v) + 1) / (n_train + vocab_size);
    cross_entropy = -mean over val tokens t of log p(t).
    """
    log_p = unigram_log_probs(train_tokens, vocab_size)
    val_counts = np.bincount(np.asarray(val_tokens), minlength=vocab_size).astype(np.float64)
    if val_counts.size > vocab_size:
        raise ValueError(f"token id >= vocab_size {vocab_size}")
    cross_entropy = float(-(val_counts @ log_p) / val_counts.sum())
    return {"cross_entropy_nats": cross_entropy, "perplexity": math.exp(cross_entropy),
            "smoothing": "add-one", "estimated_on": "train"}


def _encoded(tokenizer: Tokenizer, documents: Sequence[str], desc: str) -> Iterator[list[int]]:
    """Token ids of each document in order, encoded in chunks, with a progress bar."""
    from tqdm import tqdm

    with tqdm(total=len(documents), desc=f"tokenizing {desc}", unit="doc", disable=None) as bar:
        for start in range(0, len(documents), ENCODE_CHUNK):
            chunk = list(documents[start:start + ENCODE_CHUNK])
            yield from tokenizer.encode_batch(chunk)
            bar.update(len(chunk))


def prepare(cfg: PrepareConfig) -> Path:
    """Build the prepared folder ``cfg.out`` (see shards.py for its layout) and return its path."""
    started = time.perf_counter()
    check_output_folder(cfg.out)  # fail before the slow work, not after it
    corpus = load_corpus(cfg.corpus, cache_dir=cfg.cache_dir)
    documents = list(corpus.documents())
    total_documents = len(documents)
    if cfg.max_documents is not None:
        documents = documents[: cfg.max_documents]
    train_idx, val_idx = split_documents(len(documents), cfg.val_fraction, cfg.seed)
    splits = {"train": [documents[i] for i in train_idx], "val": [documents[i] for i in val_idx]}
    log.info("corpus %s: %d documents (%d train, %d val)", corpus.name, len(documents),
             len(train_idx), len(val_idx))

    tokenizer = build_tokenizer(cfg.tokenizer, lambda: iter(splits["train"]), cache_dir=cfg.cache_dir)
    log.info("tokenizer %s: vocab_size %d, eot %d", tokenizer.name, tokenizer.vocab_size, tokenizer.eot_id)

    with ShardWriter(cfg.out, tokenizer.vocab_size, tokenizer.eot_id) as writer:
        tokenizer.save(writer.directory)
        for split, texts in splits.items():
            stats = writer.write_split(split, _encoded(tokenizer, texts, split))
            log.info("%s: %d tokens in %d documents", split, stats.tokens, stats.documents)
        train_tokens = np.fromfile(writer.path("train"), dtype=writer.dtype)
        baseline = unigram_baseline(train_tokens, np.fromfile(writer.path("val"), dtype=writer.dtype),
                                    tokenizer.vocab_size)
        # kept so that any held-out tokens (a subset, a text file) get a baseline on the same tokens
        np.save(writer.directory / UNIGRAM_FILE, unigram_log_probs(train_tokens, tokenizer.vocab_size))
        manifest = {
            "corpus": {"spec": cfg.corpus, "name": corpus.name, "sources": corpus.sources,
                       "documents_total": total_documents},
            "tokenizer": tokenizer.name,
            "vocab_size": tokenizer.vocab_size,
            "val_fraction": cfg.val_fraction,
            "seed": cfg.seed,
            "max_documents": cfg.max_documents,
            "unigram_baseline": baseline,
            "unigram_file": UNIGRAM_FILE,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
            "environment": environment_info(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - started, 2),
        }
        out = writer.commit(manifest)
    log.info("unigram baseline on val: %.4f nats/token (perplexity %.1f)",
             baseline["cross_entropy_nats"], baseline["perplexity"])
    log.info("prepared %s in %.1f s", out, time.perf_counter() - started)
    return out



def prepare_and_describe(cfg: PrepareConfig) -> list[str]:
    """``rdepth prepare`` as one call: prepare, then the lines that describe the result."""
    from rdepth.data.shards import TokenShards

    out = prepare(cfg)
    manifest = TokenShards.open(out).manifest
    splits, baseline = manifest["splits"], manifest["unigram_baseline"]
    lines = [str(out)]
    for split in ("train", "val"):
        lines.append(f"  {split}: {splits[split]['tokens']:,} tokens, {splits[split]['documents']:,} documents")
    lines.append(f"  tokenizer {manifest['tokenizer']} (vocab {manifest['vocab_size']}, dtype {manifest['dtype']})")
    lines.append(f"  unigram baseline on val: {baseline['cross_entropy_nats']:.4f} nats/token, "
                 f"perplexity {baseline['perplexity']:.2f}")
    return lines
