"""``python -m batchweave.testing.moto_server``: moto's S3 server with atomic create-only puts.

moto answers a ``PUT`` with ``If-None-Match: *`` by checking that the key is absent and
then storing the object, two steps on a threaded server: two racing PUTs of one key can
both succeed, the later silently replacing the earlier (8 writers racing for each of 300
keys: 10 keys had two winners). S3 itself makes the conditional put atomic, and
BatchWeave's commit protocol rests on exactly that: with plain moto, a commit that lost
such a race would report success and then vanish from the log. One lock around moto's
object PUT and POST handlers restores S3's behaviour; moto is otherwise unchanged.
Takes the arguments of ``python -m moto.server``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from moto.s3.responses import S3Response
from moto.server import main

_WRITE_LOCK = threading.Lock()


def _serialized(handler: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(handler)
    def locked(self: S3Response, *args: Any, **kwargs: Any) -> Any:
        with _WRITE_LOCK:
            return handler(self, *args, **kwargs)

    return locked


S3Response.put_object = _serialized(S3Response.put_object)  # If-None-Match check + store
S3Response._key_response_post = _serialized(S3Response._key_response_post)  # multipart completion, same check

if __name__ == "__main__":
    main()
