"""The tiers plugin (tests/tiers.py) on a small suite of its own, run in process by pytester: each test
gets one tier, a plain `pytest` runs the unit tier, `-m` and named files select as asked."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

SUITE = '''
import pytest

@pytest.fixture
def ray_app(): return None

@pytest.fixture
def make_engine(): return None

@pytest.fixture
def engine(make_engine): return make_engine

def test_pure(): pass
def test_builds(engine): pass
def test_deploys(ray_app): pass
@pytest.mark.e2e
def test_serve_run(): pass
'''


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyprojecttoml('[tool.pytest.ini_options]\ntestpaths = ["suite"]\n'
                               'markers = ["unit: u", "engine: e", "e2e: x"]\n')
    pytester.makeconftest('pytest_plugins = ["tiers"]\n')
    pytester.mkdir("suite")
    (pytester.path / "suite" / "test_mixed.py").write_text(SUITE)
    return pytester


def selected(result: pytest.RunResult) -> set[str]:
    return {line.split("::")[-1] for line in result.outlines if "::" in line}


def test_a_plain_pytest_runs_the_unit_tier_only(suite):
    assert selected(suite.runpytest("--co", "-q")) == {"test_pure"}, "the default is the unit tier"


@pytest.mark.parametrize(("expression", "tests"), [
    ("engine", {"test_builds"}),
    ("e2e", {"test_deploys", "test_serve_run"}),
    ("unit or engine or e2e", {"test_pure", "test_builds", "test_deploys", "test_serve_run"}),
])
def test_each_tier_holds_its_tests(suite, expression, tests):
    assert selected(suite.runpytest("--co", "-q", "-m", expression)) == tests, (
        f"-m {expression!r}: an engine fixture (also through another fixture) is engine, ray_app or "
        "the e2e mark is e2e")


def test_named_files_run_every_tier_in_them(suite):
    everything = {"test_pure", "test_builds", "test_deploys", "test_serve_run"}
    assert selected(suite.runpytest("--co", "-q", "suite/test_mixed.py")) == everything, (
        "naming a file selects all its tests")
