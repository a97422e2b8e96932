"""The test tiers: unit (what a plain `pytest` runs), engine and e2e; every test is in exactly one.

A test is e2e when it starts a Ray app (the `ray_app` fixture) or is marked `e2e` by hand (it starts
`serve run`); else engine when it builds an engine or a PEFT reference (`make_engine`, `peft_model`,
or a fixture that uses them); else unit. A plain `pytest` (its configured test paths, no `-m`) runs the
unit tier only; naming files or folders, or giving `-m`, selects as asked; `-m "unit or engine or
e2e"` (`ALL_TIERS`) runs the whole suite. Loaded by tests/conftest.py as a plugin.
"""

from __future__ import annotations

import pytest

TIERS = ("unit", "engine", "e2e")
ALL_TIERS = " or ".join(TIERS)
E2E_FIXTURES = frozenset({"ray_app"})
ENGINE_FIXTURES = frozenset({"make_engine", "peft_model"})


def tier_of(item: pytest.Item) -> str:
    names = set(getattr(item, "fixturenames", ()))
    if names & E2E_FIXTURES or item.get_closest_marker("e2e") is not None:
        return "e2e"
    if names & ENGINE_FIXTURES or item.get_closest_marker("engine") is not None:
        return "engine"
    return "unit"


def pytest_configure(config: pytest.Config) -> None:
    if not config.option.markexpr and config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        config.option.markexpr = "unit"


def pytest_report_header(config: pytest.Config) -> str:
    return (f"tiers: -m {config.option.markexpr or 'any'!r} (a plain pytest runs the unit tier; "
            f"the whole suite: -m {ALL_TIERS!r})")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(tier_of(item))
