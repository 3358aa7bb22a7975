"""Least privilege, on real servers with one identity per role (docs/guides/permissions.md).

Each role runs with exactly the policy ``batchweave.permissions.s3_policy`` gives it:

- on **moto**, as IAM user policies that moto enforces (the very same JSON; moto matches
  actions and resources, and ignores the ``s3:prefix`` condition of listings);
- on **SeaweedFS**, translated to identity actions scoped to the namespace prefix
  (``seaweedfs_actions``); its ``Write`` also allows deletes, so a producer without
  delete permission is shown on moto only.

Every identity is allowed one namespace (``s3://BUCKET/nsN``); each test takes a fresh
one. Requests are counted per kind by the store handle each role uses, so "never writes"
is a count of zero, not the absence of an error.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import obstore.exceptions as obs_errors
import pool_work
import pytest
from conftest import _serve
from obstore_errors import obstore_status_message

import batchweave as bw
from batchweave import cli, keys
from batchweave.permissions import ROLES, s3_policy
from batchweave.store import Store, translate_error
from batchweave.store import core as store_core
from batchweave.testing import servers
from batchweave.testing.interleave import AmbiguousOnceStore

BUCKET = "batchweave-iam"
# Identities are made when the server starts, for namespaces known then: more than the
# tests of one server take in one process.
NAMESPACES = [f"ns{i}" for i in range(12)]
DOCS = Path(__file__).resolve().parent.parent / "docs" / "guides" / "permissions.md"


class CountingStore(Store):
    """A store handle signed as one identity, counting its requests by kind."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[str] = []

    def _perform(self, request, nbytes, op):
        self.requests.append(request)
        return super()._perform(request, nbytes, op)

    def count(self, *kinds: str) -> int:
        return sum(self.requests.count(kind) for kind in kinds)


@dataclass
class Server:
    """A server whose identities are each allowed one role on one namespace."""

    name: str
    endpoint: str
    identities: dict[tuple[str, str], servers.S3Identity]  # (namespace, role) -> keys
    free: itertools.count

    def namespace(self) -> Namespace:
        return Namespace(self, NAMESPACES[next(self.free)])


@dataclass
class Namespace:
    server: Server
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{BUCKET}/{self.prefix}"

    def store(self, role: str, prefix: str | None = None) -> CountingStore:
        """A handle on this namespace (or another prefix of the bucket) signed as ``role``."""
        identity = self.server.identities[(self.prefix, role)]
        return CountingStore(f"s3://{BUCKET}/{prefix or self.prefix}", storage_options=identity.storage_options())


def _policies() -> dict[tuple[str, str], dict]:
    return {(ns, role): s3_policy(role, BUCKET, ns) for ns in NAMESPACES for role in ROLES}


@pytest.fixture(scope="module")
def moto_iam(services_dir):
    """A moto server of its own (its IAM checks are for the whole server), one IAM user
    per (namespace, role) with that role's policy, checks on."""
    workdir = services_dir / "moto-iam"
    workdir.mkdir(exist_ok=True)
    svc = _serve(servers.start_moto, workdir)
    try:
        servers.create_bucket(svc.endpoint, BUCKET)
        users = servers.enforce_moto_iam(svc.endpoint, {f"{ns}-{role}": p for (ns, role), p in _policies().items()})
        identities = {(ns, role): users[f"{ns}-{role}"] for ns, role in _policies()}
        yield Server("moto", svc.endpoint, identities, itertools.count())
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def seaweedfs_iam(services_dir):
    """SeaweedFS with one identity per (namespace, role), allowed that role's policy as
    SeaweedFS can express it."""
    identities = {
        (ns, role): servers.S3Identity(
            f"{ns}-{role}", f"{ns}-{role}-key", f"{ns}-{role}-secret", servers.seaweedfs_actions(policy)
        )
        for (ns, role), policy in _policies().items()
    }
    workdir = services_dir / "seaweedfs-iam"
    workdir.mkdir(exist_ok=True)
    svc = _serve(lambda _: servers.start_seaweedfs(workdir, BUCKET, identities=list(identities.values())), workdir)
    try:
        yield Server("seaweedfs", svc.endpoint, identities, itertools.count())
    finally:
        svc.stop()


def _server_params():
    return [
        pytest.param("moto_iam", id="moto", marks=pytest.mark.s3),
        pytest.param("seaweedfs_iam", id="seaweedfs", marks=pytest.mark.seaweedfs),
    ]


@pytest.fixture
def namespace(request, monkeypatch) -> Namespace:
    """A fresh namespace on the server named by the test's parameter; the environment
    points at the server but holds no keys: each handle signs as its own identity."""
    server: Server = request.getfixturevalue(request.param)
    for var in (*servers.S3_ENV_UNSET, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    for var, value in servers.s3_env(server.endpoint).items():
        if not var.startswith("AWS_ACCESS_KEY") and not var.startswith("AWS_SECRET"):
            monkeypatch.setenv(var, value)
    # A new process's probe cache: each test sees its writers probe (and fail to clean up).
    monkeypatch.setattr(store_core, "_create_only_checked", {})
    return server.namespace()


def _tgb(step: int) -> list[bytes]:
    return [b"tgb-%d" % step]


def _produce(store: Store, steps: int, producer_id: str = "prep", **options) -> None:
    with bw.Producer(store, producer_id, dp=1, commit_policy=bw.Manual(), **options) as producer:
        for step in range(steps):
            producer.append(_tgb(step))
            producer.flush()  # one log version per TGB: a long tail of versions


# -- consumers ---------------------------------------------------------------------------

# Versions with no snapshot among them: a reader loading this tail once wrote the missing
# snapshot itself (Journal.load_state healed a tail of 2 * DEFAULT_SNAPSHOT_EVERY versions).
LONG_TAIL = 2 * 100 + 5


@pytest.mark.parametrize("namespace", _server_params(), indirect=True)
def test_read_only_consumer_trains_end_to_end_and_never_writes(namespace, caplog):
    """Read-only credentials (GetObject, ListBucket) read every step and resume from a
    cursor over a long tail of versions without a snapshot, making no write request at
    all; the snapshot is then written by the next writer that loads that tail."""
    producer = namespace.store("producer")
    _produce(producer, LONG_TAIL, snapshot_every=10**6)
    assert _keys(producer, "_log/_snapshots/") == []
    reader = namespace.store("consumer")
    caplog.set_level(logging.WARNING, logger="batchweave")
    caplog.clear()  # (the producer's denied probe cleanup is logged above)
    with bw.Consumer(reader, dp=1, rank=0, timeout_s=30) as consumer:
        steps = iter(consumer)
        got = [bytes(next(steps).data)]
        cursor = consumer.state_dict()
        got += [bytes(next(steps).data) for _ in range(LONG_TAIL - 1)]
    assert got == [b"tgb-%d" % step for step in range(LONG_TAIL)]
    with bw.Consumer(reader, dp=1, rank=0, timeout_s=30) as resumed:
        resumed.load_state_dict(cursor)  # loads the newest state: the whole tail
        assert bytes(next(iter(resumed)).data) == b"tgb-1"
    assert bw.inspect_namespace(reader).steps == LONG_TAIL  # the other reader: loads it too
    assert reader.count("put", "delete") == 0, reader.requests
    assert "could not write" not in caplog.text and "access denied" not in caplog.text
    assert _keys(producer, "_log/_snapshots/") == []
    with pytest.raises(bw.StorePermissionError) as denied:  # the server would have refused one
        reader.put_if_absent("_log/_snapshots/00000000000000000200.json", b"{}")
    assert denied.value.action == "s3:PutObject"
    bw.end_stream(producer)  # a writer loading the same tail heals it at its commit
    assert len(_keys(producer, "_log/_snapshots/")) == 1


@pytest.mark.parametrize("namespace", _server_params(), indirect=True)
def test_training_ranks_mark_and_release_checkpoints_with_put_on_checkpoints_only(namespace):
    _produce(namespace.store("producer"), 3)
    trainer = namespace.store("trainer")
    with bw.Consumer(trainer, dp=1, rank=0, timeout_s=30) as consumer:
        assert [bytes(next(iter(consumer)).data) for _ in range(2)] == [b"tgb-0", b"tgb-1"]
        consumer.mark_checkpoint("step-2")
    bw.release_checkpoint(trainer, "step-2")
    assert trainer.count("put") == 2 and trainer.count("delete") == 0  # the watermark, the release marker
    with pytest.raises(bw.StorePermissionError, match=r"_log/_last_snapshot\.json: access denied") as denied:
        trainer.put("_log/_last_snapshot.json", b'{"version": 1}')
    assert denied.value.action == "s3:PutObject"


# -- producers -----------------------------------------------------------------------------


@pytest.mark.parametrize("namespace", [_server_params()[0]], indirect=True)
def test_producer_without_delete_permission_commits_directly_and_by_group_commit(namespace, caplog):
    """Direct commits, group commits (which delete committed intents) and a restart of a
    group producer (which sweeps its crashed incarnation's intents) all work without
    s3:DeleteObject; the first denied delete is logged once, then none is tried again,
    and the collector deletes what was left."""
    caplog.set_level(logging.INFO, logger="batchweave")
    direct = namespace.store("producer")
    _produce(direct, 2)
    grouped = namespace.store("producer")
    for incarnation in range(2):  # the second one finds the first one's intents
        with bw.Producer(grouped, "pool-0", dp=1, commit_policy="group") as producer:
            offset = producer.resume_offset
            producer.append(_tgb(10 + offset), source_offset=offset)
            producer.flush()
    with bw.Consumer(namespace.store("consumer"), dp=1, rank=0, timeout_s=30) as consumer:
        steps = iter(consumer)
        assert [bytes(next(steps).data) for _ in range(4)] == [b"tgb-0", b"tgb-1", b"tgb-10", b"tgb-11"]
    for handle in (direct, grouped):  # the probe's cleanup was denied; nothing was deleted after it
        assert handle.count("delete") <= 1 and handle.deletes_denied is (handle.count("delete") == 1)
    assert grouped.deletes_denied
    denials = [r for r in caplog.records if "may not delete" in r.getMessage()]
    assert len(denials) == sum(h.deletes_denied for h in (direct, grouped))
    assert "s3:DeleteObject" in denials[0].getMessage()
    left = _keys(namespace.store("consumer"), "_intents/") + _keys(namespace.store("consumer"), "_probe/")
    assert left  # what the producers could not delete
    report = bw.collect_garbage(namespace.store("collector"), grace_s=0)
    assert report.deleted_intents >= 1 and report.deleted_probes >= 1
    assert _keys(namespace.store("consumer"), "_intents/") == _keys(namespace.store("consumer"), "_probe/") == []


@pytest.mark.parametrize("namespace", _server_params(), indirect=True)
def test_a_producer_pool_runs_with_the_producer_policy(namespace):
    """Regression: the pool's driver records its shard list under ``_pools/``, which the
    producer policy did not grant before the policies were derived from ``keys.WRITERS``."""
    identity = namespace.server.identities[(namespace.prefix, "producer")]
    report = bw.run_pool(
        namespace.url,
        "prep",
        list(range(6)),
        pool_work.tgb_of,
        producers=2,
        dp=pool_work.DP,
        progress=False,
        end_of_stream=True,
        storage_options=identity.storage_options(),
    )
    assert report.produced == 6
    assert _keys(namespace.store("consumer"), keys.POOL_PREFIX)  # the shard list's record


def test_every_key_prefix_has_writers_and_lives_in_keys():
    """Each prefix constant is one of ``keys.WRITERS`` or under one, and no module of the
    package spells a prefix out instead of naming it from ``keys``."""
    prefixes = {name: value for name, value in vars(keys).items() if name.endswith("_PREFIX")}
    assert set(keys.WRITERS) <= set(prefixes.values())
    for name, prefix in prefixes.items():
        assert any(prefix.startswith(top) for top in keys.WRITERS), name
    spelled = re.compile(r"[\"'](" + "|".join(re.escape(p) for p in prefixes.values()) + r")")
    package = Path(bw.__file__).parent
    found = [
        f"{path.relative_to(package)}:{number}: {line.strip()}"
        for path in package.rglob("*.py")
        if path.name != "keys.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if spelled.search(line) and not line.lstrip().startswith("#")
    ]
    assert found == [], "\n".join(found)


class AmbiguousCountingStore(AmbiguousOnceStore, CountingStore):
    """An identity's counted store whose next log-version put, once armed, is ambiguous."""


@pytest.mark.parametrize("namespace", [_server_params()[0]], indirect=True)
def test_producer_without_delete_permission_recovering_from_a_collection_is_fenced_not_denied(namespace):
    """A zombie whose view garbage collection overtook re-creates a freed log version (an
    ambiguous put) and, on recovering, would delete it again: denied, it leaves the version
    to the collector and is fenced as it must be, instead of failing on the delete."""
    zombie_store = AmbiguousCountingStore(namespace.url, storage_options=namespace.store("producer").storage_options)
    zombie = bw.Producer(zombie_store, "p", dp=1, commit_policy=bw.Manual(), snapshot_every=2)  # version 1
    _produce(namespace.store("producer"), 4, "p", snapshot_every=2)  # the new incarnation: versions 2..6
    with bw.Consumer(namespace.store("trainer"), dp=1, rank=0, timeout_s=30) as consumer:
        for _ in range(3):
            next(consumer)
        consumer.mark_checkpoint("ck3")
    collector = namespace.store("collector")
    bw.collect_garbage(collector, grace_s=0)
    reader = namespace.store("consumer")
    assert reader.size("_log/00000000000000000002.json") is None
    zombie_store.armed = True
    zombie.append(_tgb(0))
    with pytest.raises(bw.ProducerFencedError):
        zombie.flush(timeout_s=30)
    zombie.close(flush=False)
    assert zombie_store.fired == "_log/00000000000000000002.json" and zombie_store.deletes_denied
    assert reader.size(zombie_store.fired) is not None  # left in the reclaimed region
    bw.collect_garbage(collector, grace_s=0)
    assert reader.size(zombie_store.fired) is None


def _keys(store: Store, prefix: str) -> list[str]:
    return sorted(info.key for info in store.list(prefix))


# -- the collector -------------------------------------------------------------------------


@pytest.mark.parametrize("namespace", _server_params(), indirect=True)
def test_only_the_collector_deletes(namespace):
    """Garbage collection with the collector's policy reclaims below the live checkpoint;
    the other roles' credentials are refused the same deletes (on moto; SeaweedFS's
    Write lets a producer delete under the prefixes it may write)."""
    producer = namespace.store("producer")
    _produce(producer, 4)
    with bw.Consumer(namespace.store("trainer"), dp=1, rank=0, timeout_s=30) as consumer:
        steps = iter(consumer)
        for _ in range(3):
            next(steps)
        consumer.mark_checkpoint("step-3")
    collector = namespace.store("collector")
    report = bw.collect_garbage(collector, grace_s=0)
    assert report.reclaimed_steps == 3 and len(report.deleted_objects) == 3
    assert collector.count("delete") >= 3
    victim = "_log/00000000000000000004.json"
    deniers = ("consumer", "trainer") if namespace.server.name == "seaweedfs" else ("consumer", "trainer", "producer")
    for role in deniers:
        with pytest.raises(bw.StorePermissionError, match=re.escape(f"{victim}: access denied")) as denied:
            namespace.store(role).delete(victim)
        assert denied.value.action == "s3:DeleteObject"
        assert "s3:DeleteObject" in str(denied.value)


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("namespace", _server_params(), indirect=True)
def test_a_missing_permission_names_the_action_and_the_key(namespace):
    consumer = namespace.store("consumer")
    cases = [
        (lambda: consumer.put_if_absent("data/p/x.bwb", b"1"), "data/p/x.bwb", "put", "s3:PutObject"),
        (lambda: consumer.delete("data/p/x.bwb"), "data/p/x.bwb", "delete", "s3:DeleteObject"),
        (lambda: namespace.store("consumer", "elsewhere").get("data/p/x.bwb"), "data/p/x.bwb", "get", "s3:GetObject"),
    ]
    for attempt, key, request, action in cases:
        with pytest.raises(bw.StorePermissionError) as denied:
            attempt()
        assert denied.value.key == key and denied.value.action == action
        assert str(denied.value).startswith(f"{key}: access denied") and f" to {request}: " in str(denied.value)
        assert action in str(denied.value)


# -- the policies themselves ---------------------------------------------------------------


def test_the_guide_shows_the_policies_the_module_gives():
    """docs/guides/permissions.md shows each role's policy for s3://my-bucket/run-42 as
    ``s3_policy`` returns it: one source, checked."""
    text = DOCS.read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- policy: (\w+) -->\s*```json\n(.*?)```", text, re.DOTALL)
    assert sorted(role for role, _ in blocks) == sorted(ROLES)
    for role, block in blocks:
        assert json.loads(block) == s3_policy(role, "my-bucket", "run-42"), role


def test_policies_scope_every_grant_to_the_namespace():
    for role in ROLES:
        policy = s3_policy(role, "b", "/runs/42/")
        for statement in policy["Statement"]:
            for resource in statement["Resource"]:
                assert resource == "arn:aws:s3:::b" or resource.startswith("arn:aws:s3:::b/runs/42/")
            if statement["Action"] == ["s3:ListBucket"]:
                assert statement["Condition"] == {"StringLike": {"s3:prefix": ["runs/42/*"]}}
    deleters = [r for r in ROLES if any("s3:DeleteObject" in s["Action"] for s in s3_policy(r, "b")["Statement"])]
    assert deleters == ["collector"]
    assert "Condition" not in s3_policy("consumer", "b")["Statement"][0]  # a namespace at the bucket's root
    with pytest.raises(bw.ConfigError, match="unknown role"):
        s3_policy("admin", "b")


def test_the_command_line_prints_the_same_policy(capsys):
    assert cli.main(["policy", "trainer", "s3://my-bucket/run-42"]) == 0
    assert json.loads(capsys.readouterr().out) == s3_policy("trainer", "my-bucket", "run-42")
    assert cli.main(["policy", "trainer", "az://container/run-42"]) == 2
    assert "s3://" in capsys.readouterr().err


# -- the error translation, without a server -----------------------------------------------


def _bulk_delete_refusal(key: str, code: str) -> str:
    """obstore 0.12's error for a DeleteObjects request that answered 200 and refused the
    key (copied from moto's and SeaweedFS's answers)."""
    return (
        f"Generic S3 error: DeleteObjects request failed for key run-1/{key}: Access Denied (code: {code})\n\n"
        f'Debug source:\nGeneric {{\n    store: "S3",\n    source: DeleteFailed {{\n        path: "run-1/{key}",\n'
        f'        code: "{code}",\n        message: "Access Denied",\n    }},\n}}'
    )


@pytest.mark.parametrize(
    "store_url,request_kind,action",
    [
        ("s3://b/run-1", "list", "s3:ListBucket"),
        ("az://c/run-1", "put", "Microsoft.Storage/storageAccounts/blobServices/containers/blobs/write"),
        ("gs://b/run-1", "head", "storage.objects.get"),
    ],
)
def test_a_403_names_the_permission_of_the_store_kind(store_url, request_kind, action):
    key = "_log/00000000000000000409.json"
    exc = obs_errors.PermissionDeniedError(obstore_status_message(key, 403))
    got = translate_error(exc, key, request=request_kind, store=store_url)
    assert type(got) is bw.StorePermissionError and got.action == action
    assert str(got).startswith(f"{key}: access denied (HTTP 403 AccessDenied) to {request_kind}: ")
    assert action in str(got)


def test_a_bulk_delete_that_refused_the_key_is_a_permission_error():
    """obstore deletes through DeleteObjects, which answers 200 and refuses keys in its body."""
    key = "_intents/p/e000001/000000000000.json"

    def refused(code: str) -> bw.StoreError:
        exc = obs_errors.GenericError(_bulk_delete_refusal(key, code))
        return translate_error(exc, key, request="delete", store="s3://b/run-1")

    denied = refused("AccessDenied")
    assert type(denied) is bw.StorePermissionError and denied.action == "s3:DeleteObject"
    assert str(denied).startswith(f"{key}: access denied (AccessDenied) to delete: ")
    assert type(refused("InvalidArgument")) is bw.StoreError
    local = translate_error(PermissionError("read-only file system"), key, request="put", store="file:///tmp/ns")
    assert type(local) is bw.StorePermissionError and "this process may not write it" in str(local)
