"""WordNet glosses for the text probe: the data-file parser on constructed files, the gloss split, the
feature batching order, and the retention arithmetic on constructed features with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from rdepth.data.wordnet import DATA_FILES, LEXNAMES, N_LEXNAMES, load_glosses, parse_data_file
from rdepth.errors import RdepthError

HEADER = "  1 This software and database is being provided to you, the LICENSEE, by\n  2 Princeton University\n"


def synset_line(offset: int, lex: int, pos: str, words: list[str], gloss: str, pointers: str = "000") -> str:
    """One wndb(5WN) data line: offset lex_filenum ss_type w_cnt (hex) word lex_id ... p_cnt ... | gloss."""
    word_part = " ".join(f"{word} 0" for word in words)
    return f"{offset:08d} {lex:02d} {pos} {len(words):02x} {word_part} {pointers} | {gloss}  \n"


def write_wordnet(folder, entries: dict[str, list[tuple[int, str, str]]]) -> None:
    """Four data files; ``entries``: file name -> [(lex_filenum, ss_type, gloss)]."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in DATA_FILES:
        lines = [synset_line(1000 + 100 * i, lex, pos, [f"w{i}"], gloss)
                 for i, (lex, pos, gloss) in enumerate(entries.get(name, []))]
        (folder / name).write_text(HEADER + "".join(lines))


def test_lexnames_are_the_45_classes():
    assert N_LEXNAMES == 45 and len(set(LEXNAMES)) == 45
    assert LEXNAMES[5] == "noun.animal" and LEXNAMES[38] == "verb.motion" and LEXNAMES[44] == "adj.ppl"


def test_parser_reads_class_type_and_gloss_and_skips_the_header():
    text = HEADER + synset_line(1740, 3, "n", ["entity"], "that which is perceived") + synset_line(
        2000, 5, "n", ["dog", "domestic_dog"], 'a member of the genus Canis; "the dog barked all night"',
        pointers="002 @ 02083346 n 0000 ~ 01322604 n 0000")
    glosses = parse_data_file(text)
    assert [(g.label, g.pos) for g in glosses] == [(3, "n"), (5, "n")]
    assert glosses[0].text == "that which is perceived"
    assert glosses[1].text == 'a member of the genus Canis; "the dog barked all night"'  # trailing spaces gone


@pytest.mark.parametrize("line, message", [
    ("garbage line\n", "not a WordNet synset line"),
    (synset_line(1, 45, "n", ["x"], "too far"), "outside 0..44"),
    ("00000001 05 n 01 dog 0 000\n", "no gloss"),
    ("00000001 05 q 01 dog 0 000 | a dog\n", "not a WordNet synset line"),
])
def test_parser_rejects_corrupt_lines(line, message):
    with pytest.raises(RdepthError, match=message):
        parse_data_file(HEADER + line, "data.noun")


def test_load_glosses_from_a_folder_keeps_each_gloss_once(tmp_path):
    write_wordnet(tmp_path / "wn", {"data.noun": [(5, "n", "a barking animal"), (6, "n", "a made thing")],
                                    "data.verb": [(38, "v", "move fast"), (29, "v", "a barking animal")],
                                    "data.adj": [(0, "a", "big"), (44, "s", "broken")],
                                    "data.adv": [(2, "r", "quickly")]})
    glosses = load_glosses(tmp_path / "wn")
    assert [(g.text, g.label) for g in glosses] == [("a barking animal", 5), ("a made thing", 6), ("move fast", 38),
                                                    ("big", 0), ("broken", 44), ("quickly", 2)]
    (tmp_path / "wn" / "data.adv").unlink()
    with pytest.raises(RdepthError, match="has no data.adv"):
        load_glosses(tmp_path / "wn")


def test_probe_glosses_are_disjoint_seeded_and_sized(tmp_path):
    from rdepth.surrogate.config import SurrogateRunConfig
    from rdepth.surrogate.text_probe import probe_glosses

    write_wordnet(tmp_path / "wn", {"data.noun": [(4 + i % 20, "n", f"gloss number {i}") for i in range(40)]})
    config = SurrogateRunConfig(probe="wordnet", probe_train=25, probe_test=10, wordnet_dir=str(tmp_path / "wn"))
    train, test = probe_glosses(config)
    assert len(train) == 25 and len(test) == 10 and not {g.text for g in train} & {g.text for g in test}
    assert probe_glosses(config) == (train, test)
    other = probe_glosses(SurrogateRunConfig(probe="wordnet", probe_train=25, probe_test=10, seed=1,
                                             wordnet_dir=str(tmp_path / "wn")))
    assert other != (train, test)
    with pytest.raises(RdepthError, match="exceeds the 40 WordNet glosses"):
        probe_glosses(SurrogateRunConfig(probe="wordnet", probe_train=35, probe_test=10,
                                         wordnet_dir=str(tmp_path / "wn")))


class WordLengthTokenizer:
    """Each word is one token whose id is the word's length (a stand-in with a known answer)."""

    def token_counts(self, texts):
        return [len(text.split()) for text in texts]

    def encode(self, texts):
        from rdepth.surrogate.teachers.text import pad_batch

        return pad_batch([[len(word) for word in text.split()] for text in texts])


def test_gloss_features_come_back_in_text_order():
    from rdepth.surrogate.text_probe import gloss_features

    texts = ["a bb ccc dddd", "eeeee", "f gg", "hhh iiii jjjjj kkkkkk ll", "m"]
    features = gloss_features(WordLengthTokenizer(), texts, 2,
                              lambda ids, mask: {"sum": (ids * mask).sum(1, keepdim=True)})
    assert features["sum"].squeeze(1).tolist() == [10, 5, 3, 20, 1]  # sorted by length inside, text order out


def one_hot(labels: torch.Tensor, dims: int = 8) -> torch.Tensor:
    return torch.nn.functional.one_hot(labels, dims).float()


def test_retention_table_on_constructed_features():
    """Teacher features = one-hot class (probe exact); floor = zeros (predicts the majority training
    class); raptor = the teacher's features with half the test rows moved to a wrong class; truncated =
    the teacher's coordinates rolled (the teacher's probe misreads every row, a retrained one reads all)."""
    from rdepth.surrogate.text_probe import retention_table

    train_labels = torch.tensor([0] * 9 + [1] * 12 + [2] * 9)
    test_labels = torch.tensor([0, 1, 2] * 10)
    train, test = one_hot(train_labels), one_hot(test_labels)
    wrong = test_labels.clone()
    wrong[:15] = (wrong[:15] + 1) % 3
    features = {"teacher": (train, test), "floor": (torch.zeros(30, 4), torch.zeros(30, 4)),
                "raptor_k1": (train, one_hot(wrong)), "equal_split_k1": (train, test),
                "truncated_k1": (train.roll(1, 1), test.roll(1, 1))}
    table = retention_table(features, train_labels, test_labels, [1], {1: {"phases": [3], "equal_split": [3]}})
    floor = 1 / 3  # the zero features' probe predicts class 1, a third of the test rows
    assert table["floor"]["token_embedding_probe_accuracy"] == pytest.approx(floor)
    assert table["teacher"]["teacher_probe_accuracy"] == 1.0
    models = table["by_k"]["1"]["models"]
    assert table["by_k"]["1"]["phases"] == [3]
    raptor = models["raptor"]
    assert raptor["teacher_probe_accuracy"] == 0.5 and raptor["own_probe_accuracy"] == 0.5
    assert raptor["teacher_probe_retention"] == 0.5
    assert raptor["teacher_probe_normalised"] == pytest.approx((0.5 - floor) / (1 - floor))
    assert models["equal_split"]["own_probe_normalised"] == pytest.approx(1.0)
    truncated = models["truncated"]
    assert truncated["teacher_probe_accuracy"] == 0.0 and truncated["own_probe_accuracy"] == 1.0
    assert truncated["teacher_probe_normalised"] == pytest.approx(-floor / (1 - floor))
    assert not math.isnan(truncated["own_probe_normalised"])
