"""Test-wide settings: one deterministic Hypothesis profile, so a property test fails on every run or on none;
strict device mode for every rank the suite starts; ``gpu`` tests skipped where there is no GPU."""

import os

import pytest
from hypothesis import HealthCheck, settings

# every tensor handed to a collective must be on its rank's device (rank processes, engines and notebook kernels
# inherit it); MESHVIZ_STRICT_DEVICES=0 turns it off
os.environ.setdefault("MESHVIZ_STRICT_DEVICES", "1")

settings.register_profile(
    "meshviz", derandomize=True, deadline=None, print_blob=True, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("meshviz")


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def pytest_collection_modifyitems(config, items):
    for item in items:  # launch's own files; tests elsewhere that start it are marked where they are
        if item.path.name.startswith("test_launch"):
            item.add_marker(pytest.mark.launch)
    if any("gpu" in item.keywords for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
