"""The one storage adapter: a namespace URL in, create-only puts and range reads out.

This is the only package that knows obstore's types and errors. Everything above it
speaks in keys relative to the namespace root and in our own errors.

URLs:
    /abs/path, rel/path, file:///abs/path   local directory (the embedded default); a plain
                                            path is taken literally ('#', '?', '%' included),
                                            a file URL is percent-decoded
    memory://name                           in-process store, shared by name (tests)
    s3://bucket/prefix                      the AWS credential chain (with boto3: profiles,
                                            SSO, ~/.aws), AWS_* from the environment;
                                            AWS_ENDPOINT_URL and AWS_ALLOW_HTTP=true for a
                                            local server
    az://container/prefix                   AZURE_STORAGE_* from the environment
    gs://bucket/prefix                      GOOGLE_* from the environment
``storage_options`` (a dict) pass through to obstore's store constructor, checked here
against obstore's own typed configuration (``check_storage_options``), except BatchWeave's
own: ``retry_deadline_s`` for every kind of store, how long a request that keeps failing
with throttling, server errors or timeouts is retried (``batchweave.retry``), and
``fsync`` for local directories (see ``localfs.write_durably``).

The modules, each using only those listed after it:
    core          Store and open_store: a namespace's puts, reads, listing, deletes and
                  the create-only probe
    backends      obstore's store behind a URL, built on a Store's first request
    credentials   the AWS credential chain, resolved or refused before any request
    requests      the path of every request: fork check, rate limiter, retries
    failures      obstore's errors translated into ours (the one place that knows them)
    options       storage_options checked against obstore's typed configuration
    localfs       local directories: durable writes, staging files, direct reads
    info          ObjectInfo, what a listing yields
    identity      a Store's identity: which objects it reaches and as whom, as a digest
    urls          namespace URLs, the kind of store they name, their store root
"""

from __future__ import annotations

from batchweave.store.core import PROBE_PREFIX, Store, open_store
from batchweave.store.failures import translate_error
from batchweave.store.info import ObjectInfo
from batchweave.store.options import check_storage_options

__all__ = ["PROBE_PREFIX", "ObjectInfo", "Store", "check_storage_options", "open_store", "translate_error"]
