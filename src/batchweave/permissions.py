"""The store permissions each BatchWeave role needs, as AWS IAM policies.

One source for the policies: docs/guides/permissions.md shows what ``s3_policy`` returns
(a test checks that the page and this module agree), and the tests apply these very
policies to one identity per role on a server that enforces them.

Roles, from the least privileged:

- ``consumer``: reads a namespace (``Consumer`` without checkpoints, ``TGBDataset``,
  ``inspect_namespace``, ``watch``): lists and gets, never writes.
- ``trainer``: a consumer that marks checkpoints (``mark_checkpoint``) and releases them
  (``release_checkpoint``): also creates objects under ``_checkpoints/``.
- ``producer``: writes TGBs and commits them, directly or by group commit, and ends the
  stream (``end_stream``): also creates objects under ``data/``, ``_log/``, ``_head/``
  (copies of the newest versions), ``_intents/``, ``_claims/`` and ``_probe/``. Never
  needs to delete: what it would tidy up (committed intents, its folded epoch-claim
  ticket, the create-only probe's key) the collector deletes.
- ``collector``: garbage collection (``collect_garbage``) and releasing checkpoints: also
  creates log versions (the reclaim record, and its copies under ``_head/``), release
  markers, the probe's key and its summary for the next collection (``_gc/``), and
  deletes anything in the namespace.
  The only role that deletes.

``batchweave policy ROLE s3://bucket/prefix`` prints the policy for a namespace.
"""

from __future__ import annotations

from typing import Any

from batchweave.errors import ConfigError
from batchweave.keys import WRITERS

__all__ = ["ROLES", "s3_policy"]

ROLES = ("consumer", "trainer", "producer", "collector")

# The object prefixes (relative to the namespace) each role creates objects under, from
# the one table of prefixes and their writers.
_PUTS = {role: tuple(prefix for prefix, writers in WRITERS.items() if role in writers) for role in ROLES}


def s3_policy(role: str, bucket: str, prefix: str = "") -> dict[str, Any]:
    """The IAM policy document (a JSON-ready dict) that lets ``role`` work on the
    namespace ``s3://BUCKET/PREFIX`` and nothing else; see the module doc for the roles.

    Raises ConfigError for an unknown role or an empty bucket name.
    """
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}: choose one of {', '.join(ROLES)}")
    if not bucket or "/" in bucket:
        raise ConfigError(f"bucket must be a bucket name (no '/'), got {bucket!r}")
    root = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    objects = f"arn:aws:s3:::{bucket}/{root}"
    statements = [_list_statement(bucket, root), _statement("ReadNamespace", ["s3:GetObject"], [f"{objects}*"])]
    puts = [f"{objects}{where}*" for where in _PUTS[role]]
    if puts:
        statements.append(_statement("CreateObjects", ["s3:PutObject"], puts))
    if role == "producer":
        # A TGB object above obstore's chunk size (5 MB) is a multipart upload; one that
        # fails half-way is aborted, which needs its own action.
        statements.append(_statement("AbortFailedUploads", ["s3:AbortMultipartUpload"], [f"{objects}data/*"]))
    if role == "collector":
        statements.append(_statement("DeleteReclaimed", ["s3:DeleteObject"], [f"{objects}*"]))
    return {"Version": "2012-10-17", "Statement": statements}


def _list_statement(bucket: str, root: str) -> dict[str, Any]:
    """ListBucket is granted on the bucket; the condition keeps listings inside the namespace."""
    statement = _statement("ListNamespace", ["s3:ListBucket"], [f"arn:aws:s3:::{bucket}"])
    if root:
        statement["Condition"] = {"StringLike": {"s3:prefix": [f"{root}*"]}}
    return statement


def _statement(sid: str, actions: list[str], resources: list[str]) -> dict[str, Any]:
    return {"Sid": sid, "Effect": "Allow", "Action": actions, "Resource": resources}
