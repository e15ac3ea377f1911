"""The medium corpus (rdepth.data.medium): extractors, cleaning, dedup, the bundle round trip.

No network: sources are small archives built here and put into a private cache
folder (fetchers reuse what the cache holds); the GPT-2 BPE files come from the
usual cache, as in tests/test_data.py.
"""

from __future__ import annotations

import io
import json
import lzma
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from rdepth.data.corpora import load_corpus
from rdepth.data.medium.build import MediumCorpus
from rdepth.data.medium.bundle import MANIFEST, read_bundle, write_bundle
from rdepth.data.medium.clean import Deduplicator, drop_code_lines, is_prose, normalise
from rdepth.data.medium.debian import deb_files, fetch_deb
from rdepth.data.medium.extract import extract_verses_jsonl, html_paragraphs, pod_paragraphs
from rdepth.data.medium.sources import HTML_EXCLUDE, Source
from rdepth.data.prepare import PrepareConfig, prepare
from rdepth.errors import RdepthError

PROSE = ("The quick brown fox jumps over the lazy dog while the farmer watches from the porch, "
         "wondering whether the harvest will come in before the autumn rains.")

PAGE = """<html><head><title>Ignored</title><script>var x = 1;</script><style>p {}</style></head>
<body><div class="sphinxsidebar"><p>Quick search box text that is navigation</p></div>
<div class="wy-nav-content body" role="main"><h1>Install<a class="headerlink" href="#i">¶</a></h1>
<p>Use the <code>pip</code> tool
   to install &amp; upgrade   packages.</p>
<pre>$ pip install rdepth
>>> import rdepth</pre>
<ul><li>First item<li>Second &lt;item&gt;</ul>
<section id="header-files"><p>Header files are content.</p></section>
</div><div class="footer">Copyright 2024</div></body></html>"""


def test_html_to_paragraphs():
    assert html_paragraphs(PAGE) == [
        "Install", "Use the pip tool to install & upgrade packages.", "First item", "Second <item>",
        "Header files are content.",
    ]


def test_pod_to_paragraphs():
    pod = ("=head1 NAME\n\nperlfoo - B<bold> and C<< code >> and L<the manual|perlfunc/open>\n\n"
           "    my $x = 1;   # verbatim: code\n\n=begin html\n\n<p>raw</p>\n\n=end html\n\n"
           "=item *\n\nE<lt>tagE<gt> X<index>done\n\n=cut\n")
    assert pod_paragraphs(pod) == ["NAME", "perlfoo - bold and code and the manual", "<tag> done"]


def test_verses_become_books_of_chapters():
    lines = [{"book": "Gen", "chapter": 1, "verse": 1, "text": "In the beginning."},
             {"book": "Gen", "chapter": 1, "verse": 2, "text": "And the earth."},
             {"book": "Gen", "chapter": 2, "verse": 1, "text": "Thus."},
             {"book": "Exo", "chapter": 1, "verse": 1, "text": "Now these."}]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    assert list(extract_verses_jsonl("kjv.jsonl", data)) == [
        ["In the beginning. And the earth.", "Thus."], ["Now these."]]
    with pytest.raises(RdepthError, match=r"kjv.jsonl:1: not a verse record"):
        list(extract_verses_jsonl("kjv.jsonl", b'{"text": "no book"}'))


def test_normalise_and_prose_filter():
    assert normalise("  a\u00a0 b\t\tc \x07\r\n\r\n  second\u200b line  ") == "a b c\nsecond line"
    assert is_prose(PROSE)
    assert not is_prose("Too short to be a paragraph.")
    assert not is_prose("for (int i = 0; i < n; i++) { total += values[i]; } return total;")
    assert not is_prose("os.path.join os.path.split os.path.exists os.path.isdir os.path.isfile")
    assert not is_prose("Copyright 2001-2023, the Python Software Foundation and contributors alike.")
    assert drop_code_lines(f"{PROSE}\n$ make install\nx = compute(y)\nint main(void) {{") == PROSE


def test_dedup_exact_and_normalised():
    exact, loose = Deduplicator("exact"), Deduplicator("normalised")
    variants = [PROSE, PROSE, PROSE.upper(), PROSE.replace(",", ""), PROSE.replace("the", "teh")]
    assert [exact.first(p) for p in variants] == [True, False, True, True, True]
    assert [loose.first(p) for p in variants] == [True, False, False, False, True]
    assert (exact.dropped, loose.dropped) == (1, 3)
    short = Deduplicator("normalised", min_chars=40)
    assert [short.first("[Exit.]") for _ in range(3)] == [True, True, True]  # may recur in a play
    with pytest.raises(ValueError):
        Deduplicator("fuzzy")


def _sdist(cache: Path, name: str, version: str, files: dict[str, str]) -> None:
    """A ``NAME-VERSION.tar.gz`` in the cache, where fetch_wheel finds it without pip."""
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(cache / f"{name}-{version}.tar.gz", "w:gz") as tar:
        for path, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}-{version}/{path}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _doc_page(*paragraphs: str) -> str:
    return "<html><body>" + "".join(f"<p>{p}</p>" for p in paragraphs) + "</body></html>"


SECOND = "A second paragraph about gardens, rivers and the slow passing of summer into a long and quiet winter."
THIRD = "Yet another paragraph, this one on the history of printing presses and the spread of cheap books in Europe."


def test_medium_corpus_cleans_dedups_and_counts(tmp_path):
    cache = tmp_path / "cache"
    _sdist(cache, "fakedocs", "1.0", {
        "html/a.html": _doc_page(PROSE, "x = f(y); return x;", SECOND),
        "html/b.html": _doc_page(PROSE.upper(), THIRD),  # the near-duplicate goes
        "html/_sources/a.txt": PROSE, "html/genindex.html": _doc_page(THIRD + " index"),
        "html/c.html": _doc_page("Short."),  # nothing left: the document goes
    })
    _sdist(cache, "fakeplay", "2.0", {"play.txt": f"[Exit.]\n\n{PROSE}\n\n[Exit.]\n"})
    sources = [Source("docs", "pypi", "fakedocs", "1.0", "MIT", "html", exclude=HTML_EXCLUDE),
               Source("play", "pypi", "fakeplay", "2.0", "public domain", "text", include=r"\.txt$",
                      exclude=None, prose=False)]
    corpus = MediumCorpus(cache, sources=sources, min_document_chars=10)
    documents = list(corpus.documents())
    assert documents == [f"{PROSE}\n\n{SECOND}", THIRD, "[Exit.]\n\n[Exit.]"]
    stats = corpus.details()["sources"]
    assert [(s["name"], s["version"], s["files"], s["documents"], s["paragraphs"], s["paragraphs_duplicate"])
            for s in stats] == [("docs", "1.0", 3, 2, 3, 1), ("play", "2.0", 1, 1, 2, 1)]
    assert stats[0]["bytes"] == len(documents[0]) + len(documents[1])
    assert list(corpus.documents()) == documents  # re-iterable, same order


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_deb_files_from_cached_package(tmp_path):
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        "Package: fake-doc\nVersion: 1:2.0-1\nArchitecture: all\nMaintainer: x <x@y>\nDescription: fake\n")
    (root / "usr/share/doc/fake").mkdir(parents=True)
    (root / "usr/share/doc/fake/page.html").write_text(_doc_page(PROSE))
    (root / "usr/share/doc/fake/skip.png").write_bytes(b"\x89PNG")
    cache = tmp_path / "cache"
    cache.mkdir()
    subprocess.run(["dpkg-deb", "--build", "-Zxz", str(root), str(cache / "fake-doc_1%3a2.0-1_all.deb")],
                   check=True, capture_output=True)
    deb = fetch_deb("fake-doc", "1:2.0-1", cache)  # found in the cache: apt is never asked
    files = list(deb_files(deb, lambda path: path.endswith(".html")))
    assert files == [("/usr/share/doc/fake/page.html", _doc_page(PROSE).encode())]
    (cache / "broken_1.0_all.deb").write_bytes(b"not a deb")
    with pytest.raises(RdepthError, match="cannot read"):
        list(deb_files(cache / "broken_1.0_all.deb", lambda path: True))


def _small_corpus(folder: Path, n: int = 30) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(0)
    words = PROSE.split() + SECOND.split() + THIRD.split()
    for index in range(n):
        text = " ".join(rng.choice(words, size=120 + index))
        (folder / f"doc{index:03d}.txt").write_text(f"Document {index}. {text}")
    return folder


def test_bundle_round_trip_gives_the_same_tokens(tmp_path):
    corpus = _small_corpus(tmp_path / "corpus")
    bundle = tmp_path / "small.zip"
    direct = prepare(PrepareConfig(corpus=str(corpus), tokenizer="gpt2", out=tmp_path / "direct",
                                   bundle=bundle, val_fraction=0.2))
    kept = json.loads((direct / "manifest.json").read_text())["corpus"]["bundle"]
    assert (kept["documents"], kept["of_documents"]) == (30, 30)
    # a fresh cache: the GPT-2 files must come out of the bundle, not from a download
    again = prepare(PrepareConfig(corpus=f"bundle:{bundle}", tokenizer="gpt2", out=tmp_path / "again",
                                  val_fraction=0.2, workers=2, cache_dir=tmp_path / "fresh-cache"))
    for split in ("train", "val"):
        assert (direct / f"{split}.bin").read_bytes() == (again / f"{split}.bin").read_bytes()
    assert (tmp_path / "fresh-cache" / "gpt2-bpe" / "vocab.bpe").is_file()
    assert PrepareConfig(corpus=f"bundle:{bundle}").out == Path("data/small-bpe4096")


def test_bundle_respects_the_size_cap_and_keeps_a_prefix(tmp_path):
    rng = np.random.default_rng(1)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz    "))
    documents = ["".join(rng.choice(letters, size=5000)) for _ in range(100)]  # ~3.4x compressible at best
    cap = 200_000
    kept = write_bundle(tmp_path / "b.zip", documents, {"name": "random"}, cap, chunk_chars=50_000)
    assert (tmp_path / "b.zip").stat().st_size <= cap
    assert 0 < kept["documents"] < len(documents)
    assert list(read_bundle(tmp_path / "b.zip").documents()) == documents[:kept["documents"]]
    with pytest.raises(RdepthError, match="record separator"):
        write_bundle(tmp_path / "c.zip", ["a\x1eb"], {}, cap)


def test_bad_bundles_give_one_line_errors(tmp_path):
    def error_of(spec: str) -> str:
        with pytest.raises(RdepthError) as caught:
            list(load_corpus(spec).documents())
        assert "\n" not in str(caught.value)
        return str(caught.value)

    assert "bundle not found" in error_of(f"bundle:{tmp_path / 'missing.zip'}")
    (tmp_path / "junk.zip").write_bytes(b"\x00" * 100)
    assert "not an rdepth text bundle" in error_of(f"bundle:{tmp_path / 'junk.zip'}")
    write_bundle(tmp_path / "good.zip", [PROSE, SECOND], {"name": "x"}, 1 << 20)
    with zipfile.ZipFile(tmp_path / "good.zip") as archive:
        manifest = json.loads(archive.read(MANIFEST))
    with zipfile.ZipFile(tmp_path / "empty.zip", "w") as archive:
        archive.writestr(MANIFEST, json.dumps({**manifest, "chunks": []}))
    assert "holds no documents" in error_of(f"bundle:{tmp_path / 'empty.zip'}")
    with zipfile.ZipFile(tmp_path / "tampered.zip", "w") as archive:
        archive.writestr(MANIFEST, json.dumps(manifest))
        archive.writestr(manifest["chunks"][0]["file"], lzma.compress(b"other text"))
    assert "does not match its SHA-256" in error_of(f"bundle:{tmp_path / 'tampered.zip'}")
    with zipfile.ZipFile(tmp_path / "truncated.zip", "w") as archive:
        archive.writestr(MANIFEST, json.dumps(manifest))
        archive.writestr(manifest["chunks"][0]["file"], lzma.compress(b"x" * 1000)[:20])
    assert "corrupt" in error_of(f"bundle:{tmp_path / 'truncated.zip'}")


def test_prepare_config_checks_bundle_fields():
    with pytest.raises(RdepthError, match="workers"):
        PrepareConfig(workers=0)
    with pytest.raises(RdepthError, match="bundle_mib"):
        PrepareConfig(bundle_mib=0)


def test_cli_prepare_help_lists_bundle_flags(capsys):
    from rdepth.cli.main import main

    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    text = capsys.readouterr().out
    assert "--bundle" in text and "--bundle-mib" in text and "--workers" in text and "medium" in text
