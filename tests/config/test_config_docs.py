"""The configuration reference is generated from the fields: the docs' tables and serve_config.yaml's
commented args match the fields' descriptions and defaults, together cover every field, and the
yaml's values are the defaults (byte sizes in the unit base the defaults mean)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lora_cluster.config import ServeConfig, docs, serve_defaults


def test_every_field_of_every_section_is_in_exactly_one_group() -> None:
    for section, model in docs.SECTIONS.items():
        grouped = [name for group in docs.GROUPS if group.section == section for name in group.fields]
        where = f"section {section!r}" if section else "the top level"
        repeated = sorted({name for name in grouped if grouped.count(name) > 1})
        assert not repeated, f"fields of {where} in more than one group of config.docs.GROUPS: {repeated}"
        missing = sorted(set(docs.documented_fields(section)) - set(grouped))
        assert not missing, f"fields of {where} in no group of config.docs.GROUPS (so in no table): {missing}"
        unknown = sorted(set(grouped) - set(model.model_fields))
        assert not unknown, f"config.docs.GROUPS names fields {model.__name__} does not have: {unknown}"


def test_each_section_s_groups_are_together_so_the_yaml_nests_each_section_once() -> None:
    order = [group.section for group in docs.GROUPS]
    runs = [s for i, s in enumerate(order) if i == 0 or order[i - 1] != s]
    assert len(runs) == len(set(runs)), f"a section's groups are split in config.docs.GROUPS: {order}"


def test_the_docs_show_every_group_and_nested_model() -> None:
    shown = {key for path in docs.DOCS for keys in docs.table_keys((docs.ROOT / path).read_text())
             for key in keys}
    missing = sorted(set(docs.all_keys()) - shown)
    assert not missing, f"config tables no doc shows: {missing}"


@pytest.mark.parametrize("path", [docs.SERVE_YAML, *docs.DOCS])
def test_the_committed_file_matches_the_fields(path: str) -> None:
    assert (docs.ROOT / path).read_text() == docs.rendered(path), (
        f"{path} differs from the config fields' descriptions and defaults: run "
        "`python -m lora_cluster.config.docs` (edit descriptions in lora_cluster/config/, not the output)")


def test_serve_config_yaml_lists_every_field_at_its_default() -> None:
    values = docs.commented_args((docs.ROOT / docs.SERVE_YAML).read_text())
    defaults = serve_defaults()
    for section in docs.SECTIONS:
        given = values.get(section, {}) if section else values
        missing = sorted(set(docs.documented_fields(section)) - set(given))
        assert not missing, f"serve_config.yaml does not list {missing} (section {section!r})"
        for name, value in given.items():
            if not section and name in docs.SECTIONS:
                continue
            if name in docs.SHOWN_DEFAULTS:
                continue  # a machine-dependent default, shown as its rule
            config = ServeConfig(**({section: {name: value}} if section else {name: value}))
            built = getattr(getattr(config, section) if section else config, name)
            default = getattr(getattr(defaults, section) if section else defaults, name)
            if name == "adapter_wait_bounds_s":
                default = config.engine.adapter_wait_bounds_s  # derived from the SLA classes when unset
            assert built == default, f"serve_config.yaml's `{name}: {value}` gives {built!r}, not {default!r}"


def test_uncommenting_every_arg_gives_the_default_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORA_CLUSTER_USAGE_DB_PATH", raising=False)  # conftest points it at a temp folder
    monkeypatch.delenv("LORA_CLUSTER_RELEASE_STATE_URI", raising=False)  # conftest keeps releases in memory
    monkeypatch.delenv("LORA_CLUSTER_USAGE_SPOOL_DIR", raising=False)  # and this one too
    values = docs.commented_args((docs.ROOT / docs.SERVE_YAML).read_text())
    values.pop("demo_dir")  # machine-dependent, shown as its rule
    values["engine"].pop("adapter_wait_bounds_s")  # derived from the SLA classes unless given
    assert ServeConfig(**values) == ServeConfig(), "serve_config.yaml's args, uncommented, are the defaults"


def test_the_command_rewrites_stale_files_and_check_names_them(tmp_path: Path, monkeypatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    for path in (docs.SERVE_YAML, *docs.DOCS):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(docs.ROOT / path, tmp_path / path)
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    yaml_file = tmp_path / docs.SERVE_YAML
    yaml_file.write_text(yaml_file.read_text().replace("host_cache_bytes: 4GiB", "host_cache_bytes: 4G"))
    serving = tmp_path / "docs/serving.md"
    serving.write_text(serving.read_text().replace("| `api.max_n` |", "| `api.max_choices` |"))

    assert docs.main(["--check"]) == 1, "--check fails while a generated part is stale"
    named = capsys.readouterr().out
    assert docs.SERVE_YAML in named and "docs/serving.md" in named, f"--check names the stale files: {named}"
    assert "README.md" not in named, f"--check names only stale files: {named}"
    assert docs.main([]) == 0, "writing succeeds"
    assert docs.main(["--check"]) == 0, "after writing, nothing is stale"
    assert "host_cache_bytes: 4GiB" in yaml_file.read_text(), "the yaml's byte size is the default again"


def test_a_table_naming_an_unknown_group_is_an_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    (tmp_path / "README.md").write_text("<!-- config-table: nosuch -->\n<!-- /config-table -->\n")
    with pytest.raises(ValueError, match="nosuch"):
        docs.rendered("README.md")
