"""``python -m batchweave.testing.moto_server``: moto's S3 server with atomic create-only puts.

moto answers a ``PUT`` with ``If-None-Match: *`` by checking that the key is absent and
then storing the object, two steps on a threaded server: two racing PUTs of one key can
both succeed, the later silently replacing the earlier (8 writers racing for each of 300
keys: 10 keys had two winners). S3 itself makes the conditional put atomic, and
BatchWeave's commit protocol rests on exactly that: with plain moto, a commit that lost
such a race would report success and then vanish from the log. One lock around moto's
object PUT and POST handlers restores S3's behaviour.

With IAM checks on (``batchweave.testing.servers.enforce_moto_iam``), moto authorizes a
DeleteObjects request (how obstore deletes an S3 object) as ``s3:DeleteObject`` on the
*bucket's* ARN, where S3 checks it on each object's: a policy that allows deletes under
a prefix could then never delete. Each key is authorized on its own ARN instead. moto is
otherwise unchanged. Takes the arguments of ``python -m moto.server``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import xmltodict
from moto.s3.exceptions import BucketAccessDeniedError, S3AccessDeniedError
from moto.s3.responses import S3Response
from moto.server import main

_WRITE_LOCK = threading.Lock()


def _serialized(handler: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(handler)
    def locked(self: S3Response, *args: Any, **kwargs: Any) -> Any:
        with _WRITE_LOCK:
            return handler(self, *args, **kwargs)

    return locked


def _authorized_per_key(handler: Callable[..., Any]) -> Callable[..., Any]:
    """DeleteObjects with every key authorized on its own ARN, as S3 does. A request with
    a key that may not be deleted is refused whole (each key AccessDenied in the answer):
    obstore sends one key per request, so nothing finer is needed."""

    @functools.wraps(handler)
    def per_key(self: S3Response, bucket_name: str, authenticated: bool = True) -> Any:
        objects = xmltodict.parse(self.body, strip_whitespace=False).get("Delete", {}).get("Object", [])
        for obj in objects if isinstance(objects, list) else [objects]:
            try:  # (counts as a request while checks are off, as moto's own check does)
                self._authenticate_and_authorize_s3_action(bucket_name=bucket_name, key_name=obj["Key"])
            except (BucketAccessDeniedError, S3AccessDeniedError):
                return handler(self, bucket_name, authenticated=False)
        return handler(self, bucket_name, authenticated=True)

    return per_key


S3Response.put_object = _serialized(S3Response.put_object)  # If-None-Match check + store
S3Response._key_response_post = _serialized(S3Response._key_response_post)  # multipart completion, same check
S3Response._bucket_response_delete_keys = _authorized_per_key(S3Response._bucket_response_delete_keys)

if __name__ == "__main__":
    main()
