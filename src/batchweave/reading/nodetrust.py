"""Whom a node's hub and its ranks trust, and how each side checks it (invariant I11).

A hub is as trusted as the rank's own process, and no more: it serves only processes of
the same user, for the same job and the same store identity, and a rank talks only to
such a hub. Each check rests on what the kernel says, never on what the peer claims:

- **The place.** The hub's socket and its election lock lie in a directory only this
  user can enter (``hub_directory``): ``$XDG_RUNTIME_DIR/batchweave`` where the login
  session provides one, else ``<tmp>/batchweave-<uid>``, made with mode 0700 and refused
  when another user owns it, it is open to others, or it is a symbolic link (a trap laid
  in ``/tmp`` in advance). Another user can neither connect to the socket nor bind its
  name first.
- **The peer.** Each end reads the other's user from the kernel (``SO_PEERCRED``) and
  refuses any other (``check_peer``).
- **The name.** The socket's name and the handshake carry a digest of the job and of the
  store identity (scheme, endpoint, account, bucket, path, a fingerprint of the
  credentials: ``Store.identity``): ranks of another job or another store never meet.
- **The memory.** A range arrives as an anonymous shared-memory file (``memfd``); a rank
  maps it only when it is sealed against writes, shrinking and growing, and holds
  exactly the announced bytes (``check_memory``): nobody can change bytes after the rank
  checked their CRC, nor make the mapping fault.

Nothing here protects a rank from another process of the same user: such a process can
read the rank's memory and credentials anyway (``ptrace``, ``/proc``). See
docs/security.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import struct
import tempfile
from collections.abc import Mapping

__all__ = [
    "JOB_VARIABLES",
    "HubRefused",
    "check_memory",
    "check_peer",
    "check_uid",
    "hub_directory",
    "hub_identity",
    "job_identity",
    "peer_credentials",
]

# What tells the jobs of one node apart without a coordinator: torchrun's run id, master
# and restart count, and Slurm's job and step. Ranks of one job share them all.
JOB_VARIABLES = (
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
)
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class HubRefused(Exception):
    """A hub (or, for a hub, a peer) that must not be trusted; the message says why."""


def hub_directory(environ: Mapping[str, str] | None = None) -> str:
    """This user's private directory for hub sockets, made if need be; HubRefused when
    it cannot be trusted (see the module doc)."""
    environ = os.environ if environ is None else environ
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    if runtime and _private(runtime):
        path = os.path.join(runtime, "batchweave")
    else:
        path = os.path.join(tempfile.gettempdir(), f"batchweave-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise HubRefused(f"cannot make the hub directory {path}: {exc}") from None
    if not _private(path):
        raise HubRefused(
            f"{path} is not a directory private to uid {os.getuid()} (owned by another user, open to others, "
            "or a link): another user could reach the hub. Remove it, or set XDG_RUNTIME_DIR to a private directory"
        )
    return path


def _private(path: str) -> bool:
    """A real directory (not a link) owned by this user that nobody else may enter."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and info.st_mode & 0o077 == 0


def job_identity(environ: Mapping[str, str] | None = None) -> str:
    """The job this process belongs to, as the launcher's environment tells it ("" when
    none does: then the job is told apart by its store, mesh and node only)."""
    environ = os.environ if environ is None else environ
    return json.dumps({name: environ[name] for name in JOB_VARIABLES if name in environ}, sort_keys=True)


def hub_identity(store_identity: str, job: str, mesh: str, first_rank: int) -> str:
    """The digest a node's hub and ranks must share: store, job, mesh and node."""
    material = json.dumps([store_identity, job, mesh, first_rank]).encode()
    return hashlib.blake2b(material, digest_size=16, person=b"batchweave-hub").hexdigest()


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """The (pid, uid, gid) of the process at the other end of a Unix socket, from the kernel."""
    return _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))


def check_peer(sock: socket.socket, what: str) -> int:
    """The pid of ``sock``'s peer; HubRefused unless it runs as this process's user."""
    pid, uid, _ = peer_credentials(sock)
    check_uid(pid, uid, what)
    return pid


def check_uid(pid: int, uid: int, what: str) -> None:
    """HubRefused unless the peer ``pid`` runs as this process's user (the rule alone: the
    simulation's hub channel applies it to the credentials it draws)."""
    if uid != os.getuid():
        raise HubRefused(f"the {what} (process {pid}) runs as uid {uid}, not {os.getuid()}: refused")


def check_memory(fd: int, length: int) -> None:
    """HubRefused unless ``fd`` is a sealed memfd of exactly ``length`` bytes."""
    import fcntl  # Linux only, like memfd

    wanted = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        info = os.fstat(fd)
    except OSError as exc:
        raise HubRefused(f"the hub sent a descriptor that is not a sealed memfd ({exc})") from None
    if seals & wanted != wanted:
        raise HubRefused(f"the hub's shared memory is not sealed against writes (seals {seals:#x})")
    if not stat.S_ISREG(info.st_mode) or info.st_size != length:
        raise HubRefused(f"the hub's shared memory holds {info.st_size} bytes, not the {length} announced")
