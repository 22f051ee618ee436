"""The transport tier: the real transports (gloo processes, ipyparallel engines, a Cluster's threads, launch,
devices, the browser). Whatever ``MESHVIZ_RANKS`` the invocation has (scripts/test.sh sets ``threads`` for the
notebooks), these tests see it unset: ``run_ranks`` starts processes and a ``Cluster`` starts engines unless a test
says otherwise. Module-scoped, so it is in place before a module's own cluster fixture starts."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def _real_ranks():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MESHVIZ_RANKS", raising=False)
        yield
