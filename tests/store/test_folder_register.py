"""Registering an adapter by path (`POST /v1/load_lora_adapter`): a path naming the home folder of no
user on this host is an unknown adapter (404), not a server error (found by schemathesis in CI:
`lora_path` "~÷..." made `Path.expanduser` raise RuntimeError, answered 500)."""

from __future__ import annotations

import pytest

from lora_cluster.adapter_format import ModelShapes
from lora_cluster.errors import AdapterNotFoundError
from lora_cluster.store.folder_loader import FolderAdapterLoader


def test_a_lora_path_in_the_home_of_no_user_here_is_an_unknown_adapter(tmp_path):
    loader = FolderAdapterLoader([str(tmp_path)], ModelShapes(1, {"q_proj": (4, 6)}), 8)
    with pytest.raises(AdapterNotFoundError, match="qPD") as caught:
        loader.register("qPD", "~\u00f7\U0003f7c5w\u00a6")
    assert "home of no user" in str(caught.value), f"the error says why: {caught.value}"
