"""The test-service fixtures work: each backend URL is a fresh namespace with
create-only puts, and the non-memory ones are reachable from a child process."""

from __future__ import annotations

import subprocess
import sys

import obstore
import pytest
from obstore.exceptions import AlreadyExistsError
from obstore.store import from_url


def test_create_only_put_conflicts(backend_url):
    store = from_url(backend_url)
    assert [m for chunk in obstore.list(store) for m in chunk] == []  # fresh namespace

    obstore.put(store, "log/00000001.json", b"first", mode="create")
    with pytest.raises(AlreadyExistsError):
        obstore.put(store, "log/00000001.json", b"second", mode="create")

    assert bytes(obstore.get(store, "log/00000001.json").bytes()) == b"first"
    listed = [m["path"] for chunk in obstore.list(store, prefix="log") for m in chunk]
    assert listed == ["log/00000001.json"]  # paths are relative to the URL prefix


CHILD = """
import sys, obstore
from obstore.store import from_url
store = from_url(sys.argv[1])
assert bytes(obstore.get(store, "from-parent").bytes()) == b"hello"
obstore.put(store, "from-child", b"hi", mode="create")
"""


def test_child_process_reaches_backend(process_backend_url):
    store = from_url(process_backend_url)
    obstore.put(store, "from-parent", b"hello", mode="create")
    subprocess.run([sys.executable, "-c", CHILD, process_backend_url], check=True, timeout=60)
    assert bytes(obstore.get(store, "from-child").bytes()) == b"hi"
