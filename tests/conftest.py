"""Shared fixtures: one torch thread for every test, a small real corpus prepared once per session."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def wiki_small(tmp_path_factory):
    """The default wiki corpus (first 400 articles) with a 512-token BPE."""
    from rdepth.data.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("data") / "wiki512"
    return prepare(PrepareConfig(corpus="wiki", tokenizer="bpe:512", out=out, max_documents=400))



@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """Every test runs torch on one thread: tiny tensors gain nothing from thread hand-offs, and
    the suite's wall time stays steady on a shared 2-core machine. Commands called in-process plan
    their threads for a 1-core machine (rdepth.threads), so they keep that one thread too."""
    from rdepth.threads import Machine

    monkeypatch.setattr("rdepth.threads.machine", lambda: Machine(cores=1, load=0.0))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
