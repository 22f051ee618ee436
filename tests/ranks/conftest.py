"""The ranks tier: multi-rank semantics on ranks as threads of this process (one torch import, a reused world)."""

import pytest


@pytest.fixture(autouse=True)
def _threads(monkeypatch):
    monkeypatch.setenv("MESHVIZ_RANKS", "threads")
