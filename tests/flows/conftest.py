import pytest
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="module")
def prefect_harness():
    """A temporary Prefect API (fresh SQLite) for the flow tests of one module."""
    with prefect_test_harness(server_startup_timeout=120):
        yield
