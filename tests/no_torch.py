"""A pytest plugin (``-p tests.no_torch``) for the torch-free tests: importing torch raises, failing the test."""

import sys

__all__ = ["NoTorch", "pytest_ignore_collect"]


class NoTorch:
    """A finder first on ``sys.meta_path`` that refuses torch and its submodules."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"import {name}: the torch-free tests run with torch blocked (tests/no_torch.py)")
        return None


assert "torch" not in sys.modules, "torch was imported before the torch-free tests began"
sys.meta_path.insert(0, NoTorch())


def pytest_ignore_collect(collection_path, config):
    """Only files that say they are torch-free are collected (the others import torch to be collected at all)."""
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return "pytest.mark.torch_free" not in collection_path.read_text()
    return None
