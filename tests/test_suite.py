"""The test suite's own settings (tests/conftest.py, pyproject.toml): what keeps a bad CI run short and small."""

from tests.conftest import DEFAULT_TIER_TIMEOUT_S


def test_every_default_tier_test_has_a_timeout(request):
    """A hung default-tier test fails with its stacks after DEFAULT_TIER_TIMEOUT_S, not at CI's limit."""
    assert request.config.pluginmanager.hasplugin("timeout")
    fast = [i for i in request.session.items if not i.get_closest_marker("slow")]
    assert fast and all(i.get_closest_marker("timeout") for i in fast)
    assert request.node.get_closest_marker("timeout").args == (DEFAULT_TIER_TIMEOUT_S,)
    assert request.config.getini("timeout_method") == "thread"  # math-verify's timeouts use SIGALRM


def test_a_passing_tests_tmp_path_is_removed_when_it_ends(pytestconfig):
    """Each passing test's tmp_path goes when it ends (the suite wrote about 670 MB otherwise, kept to the end)."""
    assert pytestconfig.getini("tmp_path_retention_policy") == "failed"

