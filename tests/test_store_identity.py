"""``Store.identity``: two Stores share work (a node's hub) only when they reach the same
objects as the same principal. Two jobs on one node reading one ``s3://`` URL through two
endpoints, accounts or sets of credentials must get two identities, whether these come
from storage options or from the environment obstore reads."""

from __future__ import annotations

import os
import pickle  # only to prove the Store handle's identity survives its pickling; never on data
import re

import pytest

from batchweave.latency import LatencyStore
from batchweave.store import Store

URL = "s3://bucket/run"
SECRET = "0123456789abcdef0123456789abcdef"  # looks like a digest, so a leak would show
KEYS = {"access_key_id": "AKIDEXAMPLE", "secret_access_key": SECRET, "region": "us-east-1"}


@pytest.fixture(autouse=True)
def _no_store_environment(monkeypatch):
    """The host's cloud settings (or another test's) never decide a comparison."""
    for name in os.environ:
        if name.upper().startswith(("AWS_", "AZURE_", "GOOGLE_", "GCS_")) or name.upper() == "SERVICE_ACCOUNT":
            monkeypatch.delenv(name)


def identity(url: str = URL, **options) -> str:
    return Store(url, storage_options=options).identity


def test_two_stores_of_one_url_options_and_environment_have_one_identity(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    first = identity(**KEYS, endpoint="http://s3.staging:9000")
    again = identity(**dict(reversed(list({**KEYS, "endpoint": "http://s3.staging:9000"}.items()))))
    assert first == again
    assert re.fullmatch(r"[0-9a-f]{32}", first)
    assert Store(f"{URL}/").identity == Store(URL).identity  # the normalized URL


@pytest.mark.parametrize(
    "other",
    ["s3://bucket/run2", "s3://bucket/run/sub", "s3://other/run", "gs://bucket/run", "az://bucket/run"],
    ids=["path", "deeper-path", "bucket", "scheme-gs", "scheme-az"],
)
def test_another_path_bucket_or_kind_of_store_is_another_identity(other):
    assert identity(other) != identity(URL)


@pytest.mark.parametrize(
    "option,first,second",
    [
        ("endpoint", "https://s3.staging.example", "https://s3.example"),
        ("access_key_id", "AKIDSTAGING", "AKIDPRODUCTION"),
        ("secret_access_key", SECRET, SECRET[::-1]),  # the same key id, another secret only
        ("session_token", "token-one", "token-two"),
        ("region", "us-east-1", "eu-west-1"),
    ],
)
def test_another_endpoint_or_credential_in_the_options_is_another_identity(option, first, second):
    assert identity(**{**KEYS, option: first}) != identity(**{**KEYS, option: second})


def test_an_option_given_or_not_is_another_identity():
    assert identity(**KEYS, session_token="token") != identity(**KEYS)


@pytest.mark.parametrize(
    "variable,first,second",
    [
        ("AWS_ENDPOINT_URL", "http://127.0.0.1:9000", "http://127.0.0.1:9001"),
        ("AWS_ENDPOINT", "https://s3.staging.example", "https://s3.example"),
        ("AWS_ACCESS_KEY_ID", "AKIDSTAGING", "AKIDPRODUCTION"),
        ("AWS_SECRET_ACCESS_KEY", SECRET, SECRET[::-1]),
        ("AWS_SESSION_TOKEN", "token-one", "token-two"),
        ("AWS_PROFILE", "staging", "production"),
    ],
)
def test_another_endpoint_or_credential_in_the_environment_is_another_identity(variable, first, second, monkeypatch):
    """How the tests point S3 at a local server (conftest's _point_s3_at), and how jobs
    usually give credentials: obstore and the AWS chain read them from the environment."""
    monkeypatch.setenv(variable, first)
    before = identity()
    monkeypatch.setenv(variable, second)
    assert identity() != before
    monkeypatch.delenv(variable)
    assert identity() != before


@pytest.mark.parametrize(
    "given",
    [
        ("option", "account_name"),
        ("option", "azure_storage_account_name"),
        ("env", "AZURE_STORAGE_ACCOUNT_NAME"),
        ("env", "AZURE_STORAGE_ENDPOINT"),
        ("env", "AZURE_STORAGE_SAS_TOKEN"),
    ],
    ids=lambda given: given[1],
)
def test_another_azure_account_endpoint_or_token_is_another_identity(given, monkeypatch):
    how, name = given
    url = "az://container/run"
    identities = []
    for value in ("staging", "production"):
        if how == "env":
            monkeypatch.setenv(name, value)
            identities.append(identity(url))
        else:
            identities.append(identity(url, **{name: value}))
    assert identities[0] != identities[1]


@pytest.mark.parametrize("variable", ["GOOGLE_SERVICE_ACCOUNT", "GOOGLE_APPLICATION_CREDENTIALS", "SERVICE_ACCOUNT"])
def test_another_gcs_service_account_in_the_environment_is_another_identity(variable, monkeypatch):
    monkeypatch.setenv(variable, "/secrets/staging.json")
    before = identity("gs://bucket/run")
    monkeypatch.setenv(variable, "/secrets/production.json")
    assert identity("gs://bucket/run") != before


def test_only_the_variables_of_the_store_kind_count(monkeypatch):
    """An S3 store reads no AZURE_* variable: a tool setting one does not split a job's hub."""
    s3, azure = identity(), identity("az://container/run")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "account")
    assert identity() == s3
    assert identity("az://container/run") != azure


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_memory_and_local_stores_are_their_url(kind, tmp_path, monkeypatch):
    url = "memory://identity" if kind == "memory" else str(tmp_path)
    other = "memory://identity-2" if kind == "memory" else str(tmp_path / "other")
    before = identity(url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    assert identity(url) == before
    assert identity(other) != before
    assert LatencyStore(url, seed=1).identity == before  # a Store subclass over the same URL


def test_no_secret_appears_in_the_identity_or_the_store_repr(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    store = Store(URL, storage_options={"secret_access_key": SECRET[::-1], "session_token": SECRET.upper()})
    for shown in (store.identity, repr(store), str(store)):
        assert SECRET not in shown and SECRET[::-1] not in shown and SECRET.upper() not in shown.upper()


class _Provider:
    """A credential provider as obstore calls it; its state is the job's, not data."""

    def __init__(self, token: str) -> None:
        self.token = token

    def __call__(self) -> dict[str, str]:
        return {"access_key_id": "AKID", "secret_access_key": self.token, "token": "", "expires_at": None}


class _OtherProvider(_Provider):
    pass


def test_a_credential_provider_counts_by_its_type():
    """Documented in Store.identity: ranks of one job build the same provider."""
    assert identity(credential_provider=_Provider("one")) == identity(credential_provider=_Provider("two"))
    assert identity(credential_provider=_Provider("one")) != identity(credential_provider=_OtherProvider("one"))
    assert identity(credential_provider=_Provider("one")) != identity()


def test_the_identity_survives_pickling(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    for store in (
        Store(URL, storage_options={**KEYS, "retry_deadline_s": 5}),
        Store(str(tmp_path)),
        LatencyStore("memory://identity-pickled", seed=3),
    ):
        before = pickle.loads(pickle.dumps(store))  # pickled before its identity was computed
        assert before.identity == store.identity
        assert pickle.loads(pickle.dumps(store)).identity == store.identity


def test_an_unpickled_store_reads_the_environment_of_its_own_process(monkeypatch):
    """The identity says what this process's Store reaches: obstore builds the store from
    the environment of the process making requests, not the one that pickled it."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    store = Store(URL)
    first = store.identity
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9001")
    assert store.identity == first  # computed once per process: a hub's name does not move
    assert pickle.loads(pickle.dumps(store)).identity == identity() != first
