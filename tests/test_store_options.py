"""Issue 12, the mistakes a new user makes: storage options, credentials, mistyped URLs,
readers that would create a namespace. Each must be a clear error at once, not a hang,
a directory made by accident or a retry storm against the instance metadata endpoint."""

from __future__ import annotations

import importlib.util
import pickle
import socket
import sys
import time
import traceback
import uuid

import pytest
from conftest import S3_BUCKET

import batchweave as bw
from batchweave.store import Store, open_store
from batchweave.store import backends as store_backends
from batchweave.store import options as store_options

FAST_S = 5.0  # "within seconds": every mistake below is refused before any request that could hang

HAS_BOTO3 = importlib.util.find_spec("boto3") is not None
_AWS_CREDENTIAL_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_SKIP_SIGNATURE",
    "AWS_METADATA_ENDPOINT",
    "AWS_ENDPOINT_URL_S3",
)


def fails_fast(call, error=bw.ConfigError, match=None):
    """``call()`` raises ``error`` (matching ``match``) within FAST_S seconds; returns the error."""
    started = time.monotonic()
    with pytest.raises(error, match=match) as info:
        call()
    elapsed = time.monotonic() - started
    assert elapsed < FAST_S, f"took {elapsed:.1f} s to fail"
    return info.value


# -- mistyped URLs -----------------------------------------------------------------------

MISTYPED = [
    ("s3//bucket/run", "s3://bucket/run"),
    ("s3:/bucket/run", "s3://bucket/run"),
    ("s3:///bucket/run", "s3://bucket/run"),
    ("s3:bucket/run", "s3://bucket/run"),
    ("gs//bucket/run", "gs://bucket/run"),
    ("az:/container/run", "az://container/run"),
    ("memory//name", "memory://name"),
    ("memory:/name", "memory://name"),
    ("file//data/run", "file:///data/run"),
    ("file://data/run", "file:///data/run"),  # a host "data", not the directory /data/run
]

READERS_AND_WRITERS = {
    "Consumer": lambda url: bw.Consumer(url, dp=1, rank=0),
    "Producer": lambda url: bw.Producer(url, "p", dp=1),
    "inspect_namespace": lambda url: bw.inspect_namespace(url),
    "collect_garbage": lambda url: bw.collect_garbage(url),
    "release_checkpoint": lambda url: bw.release_checkpoint(url, "ck"),
    "end_stream": lambda url: bw.end_stream(url),
    "run_pool": lambda url: bw.run_pool(url, "pool", ["shard"], print, producers=1, dp=1, progress=False),
    "open_store": lambda url: open_store(url),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("url,fix", MISTYPED, ids=[u for u, _ in MISTYPED])
def test_a_mistyped_url_is_refused_with_the_fix(url, fix, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, call in READERS_AND_WRITERS.items():
        error = fails_fast(lambda call=call: call(url), match="mistyped namespace URL")
        assert f"did you mean {fix!r}?" in str(error), name
    assert list(tmp_path.iterdir()) == []  # no ./s3/bucket/run, no ./memory/name


def test_well_formed_urls_and_directories_named_like_schemes_are_accepted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert open_store(f"file:{tmp_path}").url == f"file://{tmp_path}"  # file:/path: one slash is RFC 8089
    assert open_store(f"file://localhost{tmp_path}").url == f"file://{tmp_path}"
    assert open_store(f"file://{tmp_path}").url == f"file://{tmp_path}"
    assert open_store("s3/run").url == f"file://{tmp_path}/s3/run"  # a directory named s3
    assert open_store("memory:///name").url == "memory:///name"
    assert open_store("s3://bucket/run/").url == "s3://bucket/run"


# -- misspelled keyword arguments and storage options ------------------------------------


def test_misspelled_keyword_arguments_are_a_type_error_at_the_call(tmp_path):
    url = f"memory://typo-{uuid.uuid4().hex}"
    with pytest.raises(TypeError, match="max_lags"):
        bw.Producer(url, "p", dp=1, max_lags=3)
    with pytest.raises(TypeError, match="max_lags"):
        bw.Consumer(url, dp=1, rank=0, max_lags=3)
    with pytest.raises(TypeError, match="region"):
        bw.inspect_namespace(url, region="eu-west-1")
    with pytest.raises(TypeError, match="grace"):
        bw.collect_garbage(url, grace=0)
    with pytest.raises(TypeError, match="endpoint"):
        bw.release_checkpoint(url, "ck", endpoint="http://x")
    with pytest.raises(TypeError, match="endpoint"):
        bw.end_stream(url, endpoint="http://x")
    with pytest.raises(TypeError, match="endpoint"):
        bw.run_pool(url, "pool", [], print, producers=1, dp=1, endpoint="http://x")
    with pytest.raises(TypeError, match="endpoint"):
        open_store(url, endpoint="http://x")
    with pytest.raises(TypeError, match="max_lags"):
        bw.Producer(str(tmp_path), "p", dp=1, max_lags=3)  # once a StoreError wrapping a TypeError


@pytest.mark.parametrize(
    "url,refusal",
    [
        ("memory://options", r"a memory store takes no storage_options but BatchWeave's own \(retry_deadline_s\)"),
        ("{tmp}", r"a local directory takes no storage_options but 'fsync' and BatchWeave's own \(retry_deadline_s\)"),
    ],
    ids=["memory", "local"],
)
def test_local_and_memory_stores_take_only_batchweaves_storage_options(url, refusal, tmp_path):
    url = url.format(tmp=tmp_path)
    for call in (
        lambda: bw.Producer(url, "p", dp=1, storage_options={"max_lag": 3}),
        lambda: bw.Consumer(url, dp=1, rank=0, storage_options={"max_lag": 3}),
        lambda: bw.inspect_namespace(url, storage_options={"region": "x", "retry_deadline_s": 5}),
    ):
        fails_fast(call, match=rf"{refusal}, got \['(max_lag|region)'\]")
    assert Store(url, storage_options={"retry_deadline_s": 5}).retry_deadline_s == 5


def test_the_retry_deadline_is_a_batchweave_option_for_every_store(monkeypatch):
    assert Store("memory://deadline").retry_deadline_s == 600  # the documented default
    store = Store("s3://b/r", storage_options={"retry_deadline_s": 90, "region": "x"})
    assert store.retry_deadline_s == 90 and pickle.loads(pickle.dumps(store)).retry_deadline_s == 90
    built = {}
    monkeypatch.setattr(store_backends, "from_url", lambda url, **options: built.update(options))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    store_backends.build_backend(store.url, store.storage_options, True, None)
    assert "retry_deadline_s" not in built and built["region"] == "x"  # stripped before obstore


@pytest.mark.parametrize(
    "value,shown",
    [
        (0, "got a value of type int that is not positive"),
        (-5.5, "got a value of type float that is not positive"),
        (float("nan"), "got a value of type float that is not finite"),
        ("600", "got a value of type str"),
        (True, "got a value of type bool"),
    ],
)
def test_a_bad_retry_deadline_names_the_key_and_the_type_not_other_values(value, shown):
    options = {"retry_deadline_s": value, "secret_access_key": "hunter2"}
    error = fails_fast(lambda: Store("s3://b/r", storage_options=options))
    assert "storage option retry_deadline_s must be a positive number of seconds (int or float)" in str(error)
    assert str(error).endswith(shown) and "hunter2" not in str(error) and "5.5" not in str(error)
    fails_fast(lambda: Store("memory://deadline", storage_options={"retry_deadline_s": value}), match=shown)


def test_object_store_options_are_checked_against_obstores_typed_config():
    error = fails_fast(lambda: bw.Consumer("s3://bucket/run", dp=1, rank=0, storage_options={"regoin": "eu-west-1"}))
    text = str(error)
    assert "s3://bucket/run: unknown storage option 'regoin' (did you mean 'region'?)" in text
    for valid in ("access_key_id", "endpoint", "region", "skip_signature", "client_options", "retry_config"):
        assert valid in text
    fails_fast(lambda: Store("az://container/run", storage_options={"region": "x"}), match="valid for az://")
    fails_fast(lambda: Store("gs://bucket/run", storage_options={"account_name": "x"}), match="valid for gs://")
    # The environment variable's spelling is the same key; kept in obstore's spelling.
    assert Store("s3://b/r", storage_options={"AWS_REGION": "eu-west-1"}).storage_options == {"region": "eu-west-1"}
    assert Store("az://c/r", storage_options={"AZURE_STORAGE_ACCOUNT_NAME": "a"}).storage_options == {
        "account_name": "a"
    }
    assert Store("gs://b/r", storage_options={"service_account": "/k.json"}).storage_options == {
        "service_account": "/k.json"
    }


def test_client_and_retry_options_are_checked_too():
    fails_fast(
        lambda: Store("s3://b/r", storage_options={"client_options": {"timeuot": "1s"}}),
        match=r"unknown keys \['timeuot'\] in storage option client_options; valid: .*timeout",
    )
    fails_fast(
        lambda: Store("s3://b/r", storage_options={"retry_config": {"max_retry": 1}}),
        match=r"unknown keys \['max_retry'\] in storage option retry_config; valid: backoff, max_retries",
    )
    fails_fast(
        lambda: Store("s3://b/r", storage_options={"retry_config": {"backoff": {"factor": 2}}}),
        match=r"retry_config\['backoff'\]",
    )
    fails_fast(lambda: Store("s3://b/r", storage_options={"credential_provider": "me"}), match="must be callable")
    fails_fast(lambda: Store("s3://b/r", storage_options={"client_options": "fast"}), match="must be a dict")
    fails_fast(lambda: Store("s3://b/r", storage_options=[("region", "x")]), match="must be a dict")
    store = Store("s3://b/r", storage_options={"region": "x", "client_options": {"timeout": "1s"}})
    assert pickle.loads(pickle.dumps(store)).storage_options == store.storage_options
    fails_fast(lambda: open_store(store, storage_options={"region": "y"}), match="not to an open Store")


# -- no secret in a message -------------------------------------------------------------

SECRET = "AKIA-SECRET-123"
# (url, storage_options, what the message must still name: keys and value types)
BAD_OPTIONS = {
    "not a dict": ("s3://b/r", SECRET, ["must be a dict", "str"]),
    "a list of pairs": ("s3://b/r", [("secret_access_key", SECRET)], ["must be a dict", "list"]),
    "a key that is not a string": ("s3://b/r", {("session_token", SECRET): 1}, ["string keys", "tuple"]),
    "an unknown key": ("s3://b/r", {"secret_acess_key": SECRET}, ["'secret_acess_key'", "secret_access_key"]),
    "client_options not a dict": ("s3://b/r", {"client_options": SECRET}, ["client_options", "str"]),
    "retry_config not a dict": ("s3://b/r", {"retry_config": SECRET}, ["retry_config", "str"]),
    "credential_provider a token": ("s3://b/r", {"credential_provider": SECRET}, ["credential_provider", "str"]),
    "an unknown client option": ("az://c/r", {"client_options": {"proxy_password": SECRET}}, ["proxy_password"]),
    "an unknown backoff key": ("s3://b/r", {"retry_config": {"backoff": {"factor": SECRET}}}, ["factor", "backoff"]),
    "fsync on an object store": ("gs://b/r", {"fsync": SECRET}, ["'fsync'", "local directories only"]),
    "fsync not a bool": ("{tmp}", {"fsync": SECRET}, ["'fsync'", "str"]),
    "a memory store": ("memory://secrets", {"session_token": SECRET}, ["session_token"]),
    "a local directory": ("{tmp}", {"account_key": SECRET}, ["account_key"]),
}


@pytest.mark.parametrize("url,options,named", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_storage_options_are_named_by_key_and_type_never_by_value(url, options, named, tmp_path):
    url = url.format(tmp=tmp_path)
    error = fails_fast(lambda: Store(url, storage_options=options))
    shown = "".join(traceback.format_exception(error))  # chained causes included
    assert SECRET not in shown, shown
    for part in named:
        assert part in str(error), (part, str(error))


def test_a_value_obstore_cannot_parse_is_not_echoed(monkeypatch):
    """obstore's own message quotes the value ('failed to parse "..." as boolean')."""
    store = Store("s3://b/r", storage_options={"skip_signature": SECRET, "client_options": {"allow_http": SECRET}})
    error = fails_fast(lambda: store.size("k"))
    shown = "".join(traceback.format_exception(error))
    assert SECRET not in shown, shown
    assert "<value of skip_signature>" in str(error) or "<value of client_options.allow_http>" in str(error)


def test_a_store_and_a_pool_job_do_not_show_their_options():
    from batchweave.pool import PoolJob
    from batchweave.writing.options import ProducerOptions

    options = {"secret_access_key": SECRET, "session_token": SECRET, "region": "x"}
    store = Store("s3://b/r", storage_options=options)
    assert SECRET not in repr(store) and SECRET not in str(store)
    job = PoolJob.of(store.url, None, [], print, 1, 1, 0, ProducerOptions(storage_options=options))  # type: ignore[arg-type]
    assert SECRET not in repr(job) and "s3://b/r" in repr(job)


def test_the_typed_configs_are_read_from_this_obstore():
    """The lists come from obstore's stubs: a release that moves them fails here."""
    keys = store_options._typed_config_keys
    assert {"access_key_id", "secret_access_key", "session_token", "region", "endpoint", "skip_signature"} <= keys("s3")
    assert {"account_name", "account_key", "use_emulator", "endpoint"} <= keys("az")
    assert {"service_account", "service_account_key", "application_credentials"} <= keys("gs")
    assert {"allow_http", "timeout", "connect_timeout"} <= keys("client_options")
    assert keys("retry_config") == {"backoff", "max_retries", "retry_timeout"}
    assert keys("backoff") == {"init_backoff", "max_backoff", "base"}


@pytest.mark.s3
def test_storage_options_reach_obstore(moto_server, monkeypatch):
    """No endpoint in the environment: only the options can lead the store to moto."""
    _aws_environment(monkeypatch, keys=True)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    url = f"s3://{S3_BUCKET}/options-{uuid.uuid4().hex}"
    options = {"endpoint": moto_server, "client_options": {"allow_http": True}}
    with bw.Producer(url, "p", dp=1, storage_options=options) as producer:
        producer.append([b"one"], source_offset=0)
    bw.end_stream(url, storage_options=options)
    with bw.Consumer(url, dp=1, rank=0, timeout_s=20, storage_options=options) as consumer:
        assert [bytes(b.data) for b in consumer] == [b"one"]
    assert bw.inspect_namespace(url, storage_options=options).steps == 1


# -- readers never create ------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_readers_refuse_a_local_directory_that_does_not_exist(tmp_path):
    missing = tmp_path / "run-24"  # the user meant run-42
    readers = {
        "Consumer": lambda: bw.Consumer(str(missing), dp=1, rank=0),
        "inspect_namespace": lambda: bw.inspect_namespace(missing),
        "collect_garbage": lambda: bw.collect_garbage(str(missing)),
        "release_checkpoint": lambda: bw.release_checkpoint(str(missing), "ck"),
        "watch": lambda: _snapshot_reader(str(missing)),
    }
    for name, call in readers.items():
        error = fails_fast(call, match="no namespace at")
        assert f"file://{missing}" in str(error) and "does not exist" in str(error), name
    assert not missing.exists()
    with bw.Producer(str(missing), "p", dp=1) as producer:  # a producer does create it
        producer.append([b"x"], source_offset=0)
    assert bw.inspect_namespace(missing).steps == 1


def _snapshot_reader(url):
    from batchweave.watch import SnapshotReader

    return SnapshotReader(url)


@pytest.mark.timeout(120)
def test_on_an_object_store_a_namespace_exists_once_something_was_committed(backend_url):
    """A prefix always "exists" on S3: the tools that inspect or tidy a namespace refuse one
    with no log version 1, no snapshot and no checkpoint; a consumer waits for the first commit."""
    if not Store(backend_url).object_store:
        pytest.skip("object stores only (S3 on moto, Azure on Azurite)")
    for call in (
        lambda: bw.inspect_namespace(backend_url),
        lambda: bw.collect_garbage(backend_url, grace_s=0),
        lambda: bw.release_checkpoint(backend_url, "ck"),
    ):
        error = fails_fast(call, match="no BatchWeave namespace at")
        assert backend_url in str(error) and "nothing committed yet" in str(error)
    consumer = bw.Consumer(backend_url, dp=1, rank=0, timeout_s=0.5)  # started before any producer: fine
    with pytest.raises(bw.StepTimeoutError):
        next(consumer)
    consumer.mark_checkpoint("ck")  # a checkpoint marked before the first commit...
    bw.release_checkpoint(backend_url, "ck")  # ...makes a namespace that can be released
    with bw.Producer(backend_url, "p", dp=1) as producer:
        producer.append([b"x"], source_offset=0)
    # Idle, the consumer probes the log at most every max_poll_interval_s (1 s, jittered):
    # wait for the commit longer than that, not the 0.5 s that only had to run out above.
    consumer.timeout_s = 10
    assert next(consumer).step == 0
    consumer.close()
    assert bw.inspect_namespace(backend_url).steps == 1
    bw.collect_garbage(backend_url, grace_s=0)


# -- credentials ---------------------------------------------------------------------------


def _aws_environment(monkeypatch, *, keys: bool, endpoint: str | None = None) -> None:
    """Only what the test sets: no credentials, profiles or metadata from the machine."""
    for var in _AWS_CREDENTIAL_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    if keys:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    if endpoint is not None:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ALLOW_HTTP", "true")


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.timeout(60)
@pytest.mark.skipif(not HAS_BOTO3, reason="boto3 is not installed")
def test_no_credentials_with_boto3_is_a_config_error_saying_what_to_set(monkeypatch):
    _aws_environment(monkeypatch, keys=False, endpoint=f"http://127.0.0.1:{_closed_port()}")
    consumer = bw.Consumer("s3://bucket/run", dp=1, rank=0, timeout_s=30)
    error = fails_fast(lambda: next(consumer), match="no AWS credentials")
    for advice in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "aws sso login", "skip_signature"):
        assert advice in str(error)
    assert "169.254.169.254" not in str(error)
    consumer.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("metadata", ["disabled", "unreachable"])
def test_no_credentials_without_boto3_is_a_config_error_not_a_metadata_timeout(metadata, monkeypatch):
    _aws_environment(monkeypatch, keys=False, endpoint=f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setitem(sys.modules, "obstore.auth.boto3", None)  # as if boto3 were not installed
    if metadata == "unreachable":
        monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
        monkeypatch.setenv("AWS_METADATA_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    error = fails_fast(
        lambda: bw.Producer("s3://bucket/run", "p", dp=1).append([b"x"], source_offset=0), match="no AWS credentials"
    )
    for advice in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "pip install 'batchweave[s3]'"):
        assert advice in str(error)
    assert ("AWS_EC2_METADATA_DISABLED" in str(error)) == (metadata == "disabled")


@pytest.mark.s3
@pytest.mark.timeout(120)
@pytest.mark.skipif(not HAS_BOTO3, reason="boto3 is not installed")
def test_a_profile_from_the_aws_files_is_used(moto_server, monkeypatch, tmp_path):
    """The standard chain through boto3: AWS_PROFILE names a profile in files that are not
    in the environment's keys; without the profile the same call is refused."""
    _aws_environment(monkeypatch, keys=False, endpoint=moto_server)
    credentials, config = tmp_path / "credentials", tmp_path / "config"
    credentials.write_text("[training]\naws_access_key_id = AKIDFROMPROFILE\naws_secret_access_key = secret\n")
    config.write_text("[profile training]\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    url = f"s3://{S3_BUCKET}/profile-{uuid.uuid4().hex}"
    fails_fast(lambda: bw.end_stream(url), match="no AWS credentials")  # no profile chosen, no default
    monkeypatch.setenv("AWS_PROFILE", "training")
    with bw.Producer(url, "p", dp=1) as producer:
        producer.append([b"from a profile"], source_offset=0)
    bw.end_stream(url)
    with bw.Consumer(url, dp=1, rank=0, timeout_s=20) as consumer:
        assert [bytes(b.data) for b in consumer] == [b"from a profile"]
    provider = Store(url)._store.credential_provider
    assert provider().get("access_key_id") == "AKIDFROMPROFILE"
