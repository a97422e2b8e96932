"""Registering an adapter by path (`POST /v1/load_lora_adapter`): a path naming the home folder of no
user on this host is an unknown adapter (404), not a server error (found by schemathesis in CI:
`lora_path` "~÷..." made `Path.expanduser` raise RuntimeError, answered 500), through the folder
loader and through the tiered store `serve run` uses (its local source)."""

from __future__ import annotations

import pytest

from lora_cluster.adapter_format import ModelShapes
from lora_cluster.errors import AdapterNotFoundError
from lora_cluster.store.admission import AdmissionPolicy
from lora_cluster.store.folder_loader import FolderAdapterLoader
from lora_cluster.store.sources import LocalSource
from lora_cluster.store.store import TieredAdapterStore

HOME_OF_NO_USER = "~L\u009a\u0095\rR\u00cb\U0007c3f5b"  # the CI's lora_path, but its surrogates


def test_a_lora_path_in_the_home_of_no_user_here_is_an_unknown_adapter(tmp_path):
    loader = FolderAdapterLoader([str(tmp_path)], ModelShapes(1, {"q_proj": (4, 6)}), 8)
    with pytest.raises(AdapterNotFoundError, match="qPD") as caught:
        loader.register("qPD", "~\u00f7\U0003f7c5w\u00a6")
    assert "home of no user" in str(caught.value), f"the error says why: {caught.value}"


def test_the_tiered_store_answers_a_lora_path_in_the_home_of_no_user_as_an_unknown_adapter(tmp_path):
    store = TieredAdapterStore([str(tmp_path)], AdmissionPolicy(ModelShapes(1, {"q_proj": (4, 6)}), 8))
    with pytest.raises(AdapterNotFoundError, match=r"FKQNXYlI2uNO4i/L/RDW\.QA") as caught:
        store.register("FKQNXYlI2uNO4i/L/RDW.QA", HOME_OF_NO_USER)
    assert "no adapter at" in str(caught.value), f"the error says why: {caught.value}"


def test_a_local_source_keeps_the_home_of_no_user_as_written_as_a_shell_does():
    assert LocalSource("~nosuchuser-here/adapters").root.as_posix() == "~nosuchuser-here/adapters", (
        "`~user` of no user here names a folder that does not exist, not an error")
