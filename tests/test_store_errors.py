"""Store errors are classified by type and HTTP status, never by words in the message.

obstore's messages hold the object's URL and the server's body, so a key such as
`_log/00000000000000000409.json` once read as a lost create-only race and one ending in
`00503.json` as an outage. These tests build errors the way obstore 0.12 formats them,
and provoke real ones from a tiny HTTP server that answers what each test asks for.
"""

from __future__ import annotations

import http.server
import logging
import socket
import threading
import time
from datetime import timedelta

import pytest
from obstore import exceptions as obs_errors
from obstore_errors import obstore_canceled_message, obstore_status_message, obstore_transport_message

import batchweave as bw
from batchweave.store import Store, translate_error
from batchweave.store import core as store_core
from batchweave.testing import servers as services

RACE_KEY = "_log/00000000000000000409.json"  # a log version whose number reads like HTTP 409
OUTAGE_KEY = "_log/00000000000000000503.json"
KEYS = [RACE_KEY, OUTAGE_KEY, "_log/00000000000000000412.json", "data/timeout/connection reset/SlowDown.bwb"]

# -- errors built like obstore's -------------------------------------------------------


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize(
    "make,want",
    [
        (lambda key: obs_errors.PermissionDeniedError(obstore_status_message(key, 403)), bw.StorePermissionError),
        (lambda key: FileNotFoundError(obstore_status_message(key, 404, code="NoSuchKey")), bw.ObjectNotFoundError),
        (lambda key: obs_errors.GenericError(obstore_status_message(key, 400, code="InvalidRequest")), bw.StoreError),
        (lambda key: obs_errors.GenericError(obstore_status_message(key, 501, code="NotImplemented")), bw.StoreError),
        (lambda key: obs_errors.GenericError(f"Generic error at {key}: something odd"), bw.StoreError),
    ],
    ids=["403", "404", "400", "501", "no-status"],
)
def test_a_key_that_reads_like_a_status_does_not_change_the_class(make, want, key):
    for conditional in (True, False):
        got = translate_error(make(key), key, conditional=conditional)
        assert type(got) is want, f"conditional={conditional}: {got!r}"
        assert got.key == key and key in str(got)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
def test_throttling_and_server_errors_are_transient(status, key):
    for conditional in (True, False):
        got = translate_error(
            obs_errors.GenericError(obstore_status_message(key, status)), key, conditional=conditional
        )
        assert type(got) is bw.TransientStoreError and f"HTTP {status}" in str(got)


@pytest.mark.parametrize("kind", ["Connect", "Request", "Timeout", "Interrupted"])
def test_requests_without_an_answer_are_transient(kind):
    got = translate_error(obs_errors.GenericError(obstore_transport_message(RACE_KEY, kind)), RACE_KEY)
    assert type(got) is bw.TransientStoreError


@pytest.mark.parametrize("key", KEYS)
def test_a_request_cancelled_on_a_reset_connection_is_transient(key):
    """Regression: a server that resets a kept-alive connection between requests (as load
    balancers do) makes hyper cancel the next request before sending it; object_store calls
    its kind Unknown, and it was a plain StoreError that stopped a producer (1 GET in 500
    through the resetting server below)."""
    for conditional in (True, False):
        got = translate_error(obs_errors.GenericError(obstore_canceled_message(key)), key, conditional=conditional)
        assert type(got) is bw.TransientStoreError, got


def test_only_a_cancelled_request_of_an_unknown_kind_is_transient():
    """The same tree with another hyper error in the place of Canceled stays a plain failure."""
    message = obstore_canceled_message(RACE_KEY, hyper_kind="User")
    assert type(translate_error(obs_errors.GenericError(message), RACE_KEY)) is bw.StoreError


def test_an_undecodable_answer_is_not_transient():
    got = translate_error(obs_errors.GenericError(obstore_transport_message(OUTAGE_KEY, "Decode")), OUTAGE_KEY)
    assert type(got) is bw.StoreError


def test_a_2xx_with_an_s3_error_body_is_transient():
    """S3 may answer 200 with an InternalError or SlowDown body; obstore reports it as a
    `Response` (status 200) after retrying it like a 5xx."""
    message = obstore_status_message(RACE_KEY, 503).replace("inner: Status {", "inner: Response {")
    message = message.replace("status: 503,", "status: 200,")
    assert type(translate_error(obs_errors.GenericError(message), RACE_KEY)) is bw.TransientStoreError


@pytest.mark.parametrize("status", [409, 412])
def test_conflicts_are_a_lost_race_only_for_create_only_puts(status):
    for exc in (
        obs_errors.GenericError(obstore_status_message(OUTAGE_KEY, status)),
        obs_errors.AlreadyExistsError(obstore_status_message(OUTAGE_KEY, status)),
        obs_errors.PreconditionError(obstore_status_message(OUTAGE_KEY, status)),
    ):
        lost = translate_error(exc, OUTAGE_KEY, conditional=True)
        assert type(lost) is bw.ObjectExistsError and f"HTTP {status}" in str(lost)
        other = translate_error(exc, OUTAGE_KEY, conditional=False)
        assert type(other) is bw.StoreError and "not a create-only put" in str(other)


def test_a_status_phrase_inside_the_key_is_not_the_status():
    """Without obstore's Debug part the Display is read, with the key and URIs taken out."""
    key = "data/Server returned non-2xx status code: 503/x.bwb"
    message = f"Generic S3 error: Error performing GET http://h/b/{key} in 1ms - Client error: bad range at {key}"
    assert type(translate_error(obs_errors.GenericError(message), key)) is bw.StoreError
    quoted = f"Object at location {key} not found: Error performing GET http://h/b/data/Server%20returned - x"
    assert type(translate_error(obs_errors.GenericError(quoted), key)) is bw.StoreError


def test_messages_name_the_key_status_and_error_code():
    got = translate_error(FileNotFoundError(obstore_status_message(RACE_KEY, 404, code="NoSuchKey")), RACE_KEY)
    assert str(got) == f"{RACE_KEY}: no such object (HTTP 404 NoSuchKey)"
    got = translate_error(
        FileNotFoundError(obstore_status_message(RACE_KEY, 404, code="NoSuchBucket")), RACE_KEY, store="s3://b/p"
    )
    assert str(got) == (
        f"{RACE_KEY}: the bucket 'b' of s3://b/p does not exist (HTTP 404 NoSuchBucket): create it "
        "(aws s3 mb s3://b), or fix the bucket name in the URL; BatchWeave never creates buckets"
    )
    got = translate_error(
        obs_errors.PreconditionError(obstore_status_message(RACE_KEY, 412)), RACE_KEY, conditional=True
    )
    assert str(got).startswith(f"{RACE_KEY}: already exists, the create-only put lost (HTTP 412")


# -- real errors from a server that answers what the test asks -------------------------


class _FaultHandler(http.server.BaseHTTPRequestHandler):
    """Answers every request with the server's current ``status``, or misbehaves."""

    protocol_version = "HTTP/1.1"

    def handle_one_request(self):
        mode = self.server.mode
        if mode == "reset":
            # SO_LINGER with a zero timeout: close() sends RST instead of FIN.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            self.close_connection = True
            return
        if mode == "hang":
            self.server.release.wait(30)  # until the client gave up (its timeout is 1 s)
            self.close_connection = True
            return
        super().handle_one_request()

    def _answer(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        status = self.server.status
        body = f"<Error><Code>Test{status}</Code><Key>{self.path}</Key></Error>".encode()
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_DELETE = do_HEAD = _answer

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fault_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FaultHandler)
    server.daemon_threads = True
    server.mode, server.status, server.release = "status", 200, threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.fixture
def fault_store(fault_server, monkeypatch):
    """A namespace on the fault server: no retries, a 1 s request timeout."""
    for var in services.S3_ENV_UNSET:
        monkeypatch.delenv(var, raising=False)
    endpoint = f"http://127.0.0.1:{fault_server.server_address[1]}"
    for var, value in services.s3_env(endpoint).items():
        monkeypatch.setenv(var, value)
    no_retries = {"max_retries": 0, "retry_timeout": timedelta(seconds=5), "backoff": {"base": 2}}

    def answer(status: int = 200, mode: str = "status") -> Store:
        fault_server.status, fault_server.mode = status, mode
        return Store(
            "s3://bucket/run-1",
            max_attempts=1,
            storage_options={"retry_config": no_retries, "client_options": {"timeout": "1s", "allow_http": True}},
        )

    return answer


@pytest.mark.parametrize(
    "status,want",
    [
        (400, bw.StoreError),
        (403, bw.StorePermissionError),
        (429, bw.TransientStoreError),
        (500, bw.TransientStoreError),
        (501, bw.StoreError),
        (502, bw.TransientStoreError),
        (503, bw.TransientStoreError),
        (504, bw.TransientStoreError),
    ],
)
def test_real_http_errors_on_a_409_key(fault_store, status, want):
    store = fault_store(status)
    for call in (
        lambda: store.put_if_absent(RACE_KEY, b"{}"),
        lambda: store.put(RACE_KEY, b"{}"),
        lambda: store.get(RACE_KEY),
    ):
        with pytest.raises(bw.StoreError) as info:
            call()
        assert type(info.value) is want and info.value.key == RACE_KEY
        assert f"HTTP {status} Test{status}" in str(info.value)


@pytest.mark.parametrize("status", [409, 412])
def test_real_conflicts_are_a_lost_race_only_for_create_only_puts(fault_store, status):
    store = fault_store(status)
    with pytest.raises(bw.ObjectExistsError):
        store.put_if_absent(OUTAGE_KEY, b"{}")
    with pytest.raises(bw.StoreError) as info:
        store.put(OUTAGE_KEY, b"{}")
    assert type(info.value) is bw.StoreError


def test_real_missing_object_on_a_503_key(fault_store):
    store = fault_store(404)
    with pytest.raises(bw.ObjectNotFoundError, match=r"HTTP 404 Test404"):
        store.get(OUTAGE_KEY)
    assert store.size(OUTAGE_KEY) is None


@pytest.mark.parametrize("mode", ["reset", "hang"])
def test_real_dropped_and_timed_out_requests_are_transient(fault_store, mode):
    store = fault_store(mode=mode)
    with pytest.raises(bw.TransientStoreError):
        store.get(RACE_KEY)


def test_real_refused_connection_is_transient(monkeypatch):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for var, value in services.s3_env(f"http://127.0.0.1:{port}").items():
        monkeypatch.setenv(var, value)
    no_retries = {"max_retries": 0, "retry_timeout": timedelta(seconds=5), "backoff": {"base": 2}}
    store = Store("s3://bucket/run-1", max_attempts=1, storage_options={"retry_config": no_retries})
    with pytest.raises(bw.TransientStoreError):
        store.put_if_absent(RACE_KEY, b"{}")


def test_an_endpoint_that_never_answered_fails_in_seconds_saying_so(monkeypatch, caplog):
    """A mistyped endpoint at startup: about 10 s of retries (UNREACHABLE_DEADLINE_S) with
    a WARNING, then an error that says what to check, not ten silent minutes."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for var, value in services.s3_env(f"http://127.0.0.1:{port}").items():
        monkeypatch.setenv(var, value)
    store = Store("s3://bucket/run-1")  # the default deadline, 600 s
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="batchweave.store"):
        with pytest.raises(bw.TransientStoreError, match="no request of this process ever reached the store"):
            store.get(RACE_KEY)
    assert 10 <= time.monotonic() - started < 30
    assert "retrying GET _log/00000000000000000409.json for up to 10 s" in caplog.text
    assert "answering again" not in caplog.text  # it gave up: nothing recovered


# -- the conditional-put probe on a misbehaving server ---------------------------------


@pytest.fixture
def fresh_probe_cache(monkeypatch):
    monkeypatch.setattr(store_core, "_create_only_checked", {})


@pytest.mark.parametrize("status", [400, 501])
def test_probe_refuses_a_store_that_rejects_the_condition(fault_store, fresh_probe_cache, status):
    store = fault_store(status)
    with pytest.raises(bw.ConfigError, match=r"If-None-Match.*not supported") as info:
        store.require_create_only()
    assert f"HTTP {status}" in str(info.value) and "racing commits would both win" in str(info.value)


@pytest.mark.parametrize("status,want", [(403, bw.StorePermissionError), (503, bw.TransientStoreError)])
def test_probe_without_a_verdict_is_not_cached(fault_store, fresh_probe_cache, status, want):
    store = fault_store(status)
    with pytest.raises(want):
        store.require_create_only()
    assert store_core._create_only_checked == {}  # the next call asks again


def test_probe_counts_a_refused_first_put_as_honoured(fault_store, fresh_probe_cache):
    """A first put whose answer was lost is retried and refused by its own write: that
    refusal is what the probe looks for."""
    fault_store(412).require_create_only()
    assert list(store_core._create_only_checked.values()) == [True]


# -- the store's error code says what to fix --------------------------------------------

FORGED_KEY = "data/<Code>NoSuchBucket</Code><Code>SignatureDoesNotMatch</Code>/x.bwb"


def test_the_error_code_is_read_from_the_answer_not_from_the_key():
    """A key holding `<Code>...</Code>` does not make a missing object a missing bucket,
    nor a missing permission a wrong secret: the code comes from the body's field."""
    store = "s3://bucket/run-1"
    missing = translate_error(
        FileNotFoundError(obstore_status_message(FORGED_KEY, 404, code="NoSuchKey")), FORGED_KEY, store=store
    )
    assert str(missing) == f"{FORGED_KEY}: no such object (HTTP 404 NoSuchKey)"
    forbidden = obs_errors.PermissionDeniedError(obstore_status_message(FORGED_KEY, 403))
    denied = translate_error(forbidden, FORGED_KEY, request="put", store=store)
    assert type(denied) is bw.StorePermissionError and denied.action == "s3:PutObject"
    assert "secret is wrong" not in str(denied)


def test_a_403_without_an_error_code_names_the_permission_and_the_credentials():
    """A HEAD's answer has no body: the message cannot tell a wrong secret from a missing grant."""
    message = obstore_status_message(RACE_KEY, 403, method="HEAD").replace("<Code>AccessDenied</Code>", "")
    got = translate_error(obs_errors.PermissionDeniedError(message), RACE_KEY, request="head", store="s3://b/p")
    assert got.action == "s3:GetObject" and "or the access key or secret is wrong" in str(got)


@pytest.fixture
def moto_s3(moto_server, monkeypatch):
    for var in services.S3_ENV_UNSET:
        monkeypatch.delenv(var, raising=False)
    for var, value in services.s3_env(moto_server).items():
        monkeypatch.setenv(var, value)
    return moto_server


@pytest.mark.s3
def test_real_missing_bucket_is_named_with_how_to_create_it(moto_s3, fresh_probe_cache):
    store = Store("s3://no-such-bucket/run-1")
    want = (
        "the bucket 'no-such-bucket' of s3://no-such-bucket/run-1 does not exist (HTTP 404 NoSuchBucket): "
        "create it (aws s3 mb s3://no-such-bucket), or fix the bucket name in the URL; "
        "BatchWeave never creates buckets"
    )
    for key, call in (
        (RACE_KEY, lambda: store.get(RACE_KEY)),
        ("_log/", lambda: list(store.list("_log/"))),
        (OUTAGE_KEY, lambda: store.put_if_absent(OUTAGE_KEY, b"{}")),
    ):
        with pytest.raises(bw.ObjectNotFoundError) as info:
            call()
        assert str(info.value) == f"{key}: {want}"
    with pytest.raises(bw.ObjectNotFoundError, match="aws s3 mb"):  # not "conditional puts not supported"
        store.require_create_only()


@pytest.mark.s3
def test_real_consumer_on_a_missing_bucket_names_it(moto_s3):
    with pytest.raises(bw.ObjectNotFoundError, match=r"the bucket 'no-such-bucket' .*aws s3 mb s3://no-such-bucket"):
        with bw.Consumer("s3://no-such-bucket/run-1", dp=1, rank=0, timeout_s=30) as consumer:
            next(iter(consumer))


@pytest.mark.azure
def test_real_missing_container_is_named_with_how_to_create_it(azurite_server, monkeypatch):
    for var in services.AZURE_ENV_UNSET:
        monkeypatch.delenv(var, raising=False)
    for var, value in services.azure_env(azurite_server).items():
        monkeypatch.setenv(var, value)
    store = Store("az://no-such-container/run-1")
    for call in (lambda: store.get(RACE_KEY), lambda: list(store.list("_log/"))):
        with pytest.raises(bw.ObjectNotFoundError) as info:
            call()
        assert "the container 'no-such-container' of az://no-such-container/run-1 does not exist (HTTP 404 " in str(
            info.value
        )
        assert "ContainerNotFound): create it (az storage container create --name no-such-container)" in str(info.value)


def test_an_expired_session_token_is_a_credentials_error_though_s3_answers_400():
    message = obstore_status_message(RACE_KEY, 400, method="GET", code="ExpiredToken")
    got = translate_error(obs_errors.GenericError(message), RACE_KEY, request="get", store="s3://b/p")
    assert type(got) is bw.StorePermissionError and got.action == ""
    assert str(got).startswith(f"{RACE_KEY}: access denied (HTTP 400 ExpiredToken): the session token has expired")


def test_azure_authentication_failed_says_the_key_is_wrong():
    """Azure answers a wrong account key or SAS with 403 AuthenticationFailed (Azurite says
    AuthorizationFailure instead, Azure's code for a firewall or RBAC refusal: no real
    server here can produce it)."""
    message = obstore_status_message(RACE_KEY, 403, method="GET", code="AuthenticationFailed")
    got = translate_error(obs_errors.PermissionDeniedError(message), RACE_KEY, request="get", store="az://c/p")
    assert str(got).startswith(
        f"{RACE_KEY}: access denied (HTTP 403 AuthenticationFailed): the account key or SAS token is wrong"
    )
    assert got.action == "" and "AZURE_STORAGE_ACCOUNT_KEY" in str(got)


@pytest.mark.seaweedfs
@pytest.mark.parametrize(
    "variable,code",
    [("AWS_SECRET_ACCESS_KEY", "SignatureDoesNotMatch"), ("AWS_ACCESS_KEY_ID", "InvalidAccessKeyId")],
)
def test_real_wrong_key_or_secret_says_so_not_a_permission(seaweedfs_server, monkeypatch, variable, code):
    """SeaweedFS checks signatures (moto does not): a wrong secret is not a missing grant."""
    for var in services.S3_ENV_UNSET:
        monkeypatch.delenv(var, raising=False)
    for var, value in services.s3_env(seaweedfs_server).items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv(variable, "wrong")
    store = Store("s3://batchweave-test/run-1")
    for key, call in ((RACE_KEY, lambda: store.get(RACE_KEY)), ("_log/", lambda: list(store.list("_log/")))):
        with pytest.raises(bw.StorePermissionError) as info:
            call()
        message = str(info.value)
        assert message.startswith(f"{key}: access denied (HTTP 403 {code}): the access key or secret is wrong")
        assert "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message
        assert info.value.action == "" and "s3:" not in message.split("The store's answer")[0]


@pytest.mark.s3
def test_real_plain_http_endpoint_without_allow_http_says_to_allow_it(moto_s3, monkeypatch):
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    store = Store("s3://batchweave-test/run-1")
    for key, call in ((RACE_KEY, lambda: store.get(RACE_KEY)), ("_log/", lambda: list(store.list("_log/")))):
        with pytest.raises(bw.StoreError) as info:
            call()
        assert type(info.value) is bw.StoreError
        assert str(info.value).startswith(
            f"{key}: {moto_s3} is a plain-HTTP endpoint, which the store client refuses unless told to allow it: "
            "set AWS_ALLOW_HTTP=true or pass storage_options={'client_options': {'allow_http': True}}"
        )
    allowed = Store("s3://batchweave-test/run-1", storage_options={"client_options": {"allow_http": True}})
    assert allowed.size(RACE_KEY) is None  # the fix works
