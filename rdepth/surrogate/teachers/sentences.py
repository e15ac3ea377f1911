"""Sentences for fitting and evaluating text surrogates, cut from a project corpus.

The corpus comes from :func:`rdepth.data.corpora.load_corpus` (``wiki`` by default, or a
path); documents are split at sentence ends, filtered by length, de-duplicated, shuffled
with a seed and split into disjoint fit and held-out evaluation sets.
"""

from __future__ import annotations

import random
import re

from rdepth.errors import RdepthError

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


def split_sentences(text: str, min_chars: int = 30, max_chars: int = 300) -> list[str]:
    """Sentences of ``text`` whose length lies in [min_chars, max_chars]."""
    pieces = (" ".join(piece.split()) for piece in _SENTENCE_END.split(text))
    return [p for p in pieces if min_chars <= len(p) <= max_chars]


def corpus_sentences(spec: str, n_fit: int, n_eval: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(fit sentences, held-out sentences), disjoint, drawn reproducibly from the corpus."""
    from rdepth.data.corpora import load_corpus

    corpus = load_corpus(spec)
    seen, sentences = set(), []
    for document in corpus.documents():
        for sentence in split_sentences(document):
            if sentence not in seen:
                seen.add(sentence)
                sentences.append(sentence)
    needed = n_fit + n_eval
    if len(sentences) < needed:
        raise RdepthError(f"corpus {spec!r} gives {len(sentences)} usable sentences, {needed} are needed "
                          "(lower --n-fit/--n-eval)")
    random.Random(seed).shuffle(sentences)
    return sentences[:n_fit], sentences[n_fit:needed]
