"""Test-wide settings: one deterministic Hypothesis profile, so a property test fails on every run or on none."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "meshviz", derandomize=True, deadline=None, print_blob=True, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("meshviz")
