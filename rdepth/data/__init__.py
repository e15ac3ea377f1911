"""Offline data pipeline: corpora, tokenizers, token shards and the batch sampler.

``rdepth prepare`` (prepare.py) turns a corpus into ``train.bin``/``val.bin``
token shards plus ``manifest.json``; training opens them with
``TokenShards.open`` and draws batches with ``BatchSampler``.
"""
