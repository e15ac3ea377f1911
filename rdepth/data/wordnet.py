"""WordNet glosses and their lexicographer classes: a labelled text set that installs offline.

Every WordNet synset has a gloss (its definition, often followed by quoted examples) and a
lexicographer file number (``lex_filenum``, 0..44): the 45 coarse classes of :data:`LEXNAMES`
(``noun.animal``, ``verb.motion``, ``adj.all``, ...). ``rdepth surrogate --probe wordnet``
trains linear probes to read that class from a sentence encoder's embedding of the gloss.

The data come from Debian's ``wordnet-base`` package: ``apt-get download`` into the rdepth
cache (:func:`rdepth.data.fetch.resolve_cache_dir`), read in place with ``dpkg-deb`` (nothing
installed, nothing committed), or from a folder holding the four ``data.*`` files (an installed
``/usr/share/wordnet``, or constructed files in tests).

Data-file lines (``wndb(5WN)``): ``offset lex_filenum ss_type w_cnt word lex_id ... | gloss``;
lines starting with two spaces are the licence header.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from rdepth.errors import RdepthError

log = logging.getLogger(__name__)

WORDNET_PACKAGE = ("wordnet-base", "1:3.0-37")
DATA_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")
PACKAGE_DIR = "/usr/share/wordnet/"

# lex_filenum -> lexicographer file name (lexnames(5WN)); the index is the class label
LEXNAMES: tuple[str, ...] = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact",
    "noun.attribute", "noun.body", "noun.cognition", "noun.communication", "noun.event", "noun.feeling",
    "noun.food", "noun.group", "noun.location", "noun.motive", "noun.object", "noun.person",
    "noun.phenomenon", "noun.plant", "noun.possession", "noun.process", "noun.quantity", "noun.relation",
    "noun.shape", "noun.state", "noun.substance", "noun.time", "verb.body", "verb.change", "verb.cognition",
    "verb.communication", "verb.competition", "verb.consumption", "verb.contact", "verb.creation",
    "verb.emotion", "verb.motion", "verb.perception", "verb.possession", "verb.social", "verb.stative",
    "verb.weather", "adj.ppl",
)
N_LEXNAMES = len(LEXNAMES)  # 45

_LINE = re.compile(r"^(\d{8}) (\d{2}) ([nvasr]) ")


@dataclass(frozen=True)
class Gloss:
    """One synset: its gloss text, lexicographer class (index into :data:`LEXNAMES`) and synset type."""

    text: str
    label: int
    pos: str


def parse_data_file(text: str, source: str = "data file") -> list[Gloss]:
    """The synsets of one WordNet ``data.*`` file's text, in file order.

    Raises RdepthError naming ``source`` and the line for a line that is neither licence header
    nor a synset (wrong fields, a class outside 0..44, no gloss).
    """
    glosses = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("  "):  # the licence header
            continue
        match = _LINE.match(line)
        if match is None:
            raise RdepthError(f"{source} line {number} is not a WordNet synset line (corrupt file?)")
        label = int(match.group(2))
        if label >= N_LEXNAMES:
            raise RdepthError(f"{source} line {number}: lexicographer file {label} outside 0..{N_LEXNAMES - 1}")
        _, bar, gloss = line.partition(" | ")
        gloss = " ".join(gloss.split())
        if not bar or not gloss:
            raise RdepthError(f"{source} line {number} has no gloss")
        glosses.append(Gloss(gloss, label, match.group(3)))
    return glosses


def _read_folder(folder: Path) -> dict[str, str]:
    texts = {}
    for name in DATA_FILES:
        path = folder / name
        if not path.is_file():
            raise RdepthError(f"WordNet folder {folder} has no {name} (expected {', '.join(DATA_FILES)})")
        try:
            texts[name] = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RdepthError(f"cannot read {path}: {exc}") from None
    return texts


def _read_package(cache_dir: str | os.PathLike | None) -> dict[str, str]:
    from rdepth.data.fetch import resolve_cache_dir
    from rdepth.data.medium.debian import deb_files, fetch_deb

    deb = fetch_deb(*WORDNET_PACKAGE, resolve_cache_dir(cache_dir))
    wanted = {PACKAGE_DIR + name for name in DATA_FILES}
    texts = {path.rsplit("/", 1)[1]: data.decode("utf-8", errors="strict")
             for path, data in deb_files(deb, lambda path: path in wanted)}
    missing = sorted(set(DATA_FILES) - set(texts))
    if missing:
        raise RdepthError(f"{deb.name} has no {', '.join(missing)} under {PACKAGE_DIR} (delete it to download again)")
    return texts


def load_glosses(folder: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None) -> list[Gloss]:
    """Every synset of WordNet with a distinct gloss, in file order (noun, verb, adj, adv).

    ``folder``: a folder with the four ``data.*`` files; None fetches Debian's ``wordnet-base``
    (``apt-get download``, cached) and reads it in place. Glosses that occur more than once
    (with different classes, or the same) are kept once, with their first class.
    """
    try:
        texts = _read_folder(Path(folder)) if folder else _read_package(cache_dir)
    except UnicodeDecodeError as exc:
        raise RdepthError(f"WordNet data is not UTF-8 text ({exc.reason})") from None
    seen, glosses = set(), []
    for name in DATA_FILES:
        for gloss in parse_data_file(texts[name], name):
            if gloss.text not in seen:
                seen.add(gloss.text)
                glosses.append(gloss)
    if not glosses:
        raise RdepthError("the WordNet data files hold no synsets")
    return glosses
