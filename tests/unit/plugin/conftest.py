"""Plugin tests start from a clean selection environment (no K3_PLATFORM, no K3_PLUGINS)."""

import pytest


@pytest.fixture(autouse=True)
def _clean_selection_env(monkeypatch):
    monkeypatch.delenv("K3_PLATFORM", raising=False)
    monkeypatch.delenv("K3_PLUGINS", raising=False)
