"""Local directories: objects as files, read with one ``pread`` and written durably.

A put writes a staging file next to its object, fsyncs it, links it into place and
fsyncs the directory (``write_durably``); a put killed in between leaves the staging file,
which ``find_staging`` finds for the garbage collector. A missing file reads as
ObjectNotFoundError; other errors are the operating system's (``OSError``), which the
store translates like obstore's.
"""

from __future__ import annotations

import contextlib
import operator
import os
import re
import secrets
from collections.abc import Callable, Iterator
from typing import TypeAlias

from batchweave.errors import ObjectNotFoundError
from batchweave.store.info import ObjectInfo

__all__ = [
    "PLAIN_KEY",
    "STAGING_NAME",
    "Buffer",
    "Data",
    "find_staging",
    "fsync_directory",
    "fsync_file",
    "make_dirs",
    "open_staging",
    "read_file",
    "remove_quietly",
    "start_writeback",
    "write_durably",
]

Buffer: TypeAlias = bytes | memoryview
Data: TypeAlias = Buffer | list[Buffer]  # one buffer, or pieces written back to back
_IOV_MAX = 1024  # buffers one writev takes (POSIX's minimum for IOV_MAX is 16; Linux's is 1024)

# Object keys BatchWeave writes: ids are letters, digits, '.', '_', '-' (keys.check_name).
PLAIN_KEY = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")


def read_file(path: str, key: str, start: int, length: int | None) -> memoryview:
    """``length`` bytes of a local file from ``start`` (all when None), with one pread."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        raise ObjectNotFoundError(key, "no such object") from None
    try:
        if length is None:
            length = os.fstat(fd).st_size - start
        return memoryview(os.pread(fd, length, start))
    finally:
        os.close(fd)


# obstore's LocalStore writes `<name>#<n>` and links it into place, but fsyncs nothing:
# after a power loss a log version that readers already consumed could vanish or come
# back empty. Local puts therefore take this path, the classic one for a durable create
# (write a temporary file, fsync it, link it in, fsync the directory): SQLite's journal,
# LevelDB's CURRENT, Git's object store.
#
# Staging names are `<name>#<18 random digits>`, the form obstore uses: its LocalStore
# hides every file named `<anything>#<digits>` from listings, so no reader, listing or
# collection ever sees one as an object, and no key BatchWeave writes can be one
# (PLAIN_KEY has no '#').
STAGING_NAME = re.compile(r"[^#]*#[0-9]+")
_STAGING_ATTEMPTS = 8  # fresh random names to try when one is taken (odds of 1e-18 each)
# A staging file deleted under a put (a collection with a grace of 0 s, or an operator)
# makes the link fail; the put writes again, this many times at most.
_VANISHED_ATTEMPTS = 3


def write_durably(
    path: str,
    data: Data,
    *,
    replace: bool,
    fsync: bool,
    opened: tuple[int, str] | None = None,
    remove_staging: Callable[[str], None] | None = None,
    size: int | None = None,
) -> list[str]:
    """Put ``data`` at ``path`` whole or not at all; durable on return when ``fsync``.

    The bytes go to a staging file in the same directory, which is fsynced, then linked
    into place (``os.link`` fails with EEXIST on an existing ``path``: create-only) or,
    with ``replace``, renamed over it; then the directory is fsynced, and so is the
    parent of every directory this put had to make, so that a new ``_log/`` or
    ``data/<producer>/e000001/`` survives a power loss too. Returns those directories
    (fsynced, or to fsync after the file: ``fsync_file``). ``opened`` is a staging file
    opened ahead (``open_staging``) on ``path``'s file system, in its directory or
    another, which the first attempt writes; ``remove_staging`` removes the staging name once it is linked (or the put
    failed), by default at once (``remove_quietly``); ``size``, when known, is ``data``'s
    size in bytes. Raises OSError (the caller translates it): FileExistsError when
    ``path`` exists and not ``replace``.
    """
    remove_staging = remove_staging or remove_quietly
    made: list[str] = []
    for attempt in range(1, _VANISHED_ATTEMPTS + 1):
        spare = opened if attempt == 1 else None
        if spare is not None:  # opened ahead, perhaps in another directory: ``path``'s may be new
            made += make_dirs(os.path.dirname(path))
        try:
            staging = _write_staging(path, data, fsync, spare, size)
        except FileNotFoundError:  # the directory is new: make it, once
            made += make_dirs(os.path.dirname(path))
            staging = _write_staging(path, data, fsync, None, size)
        try:
            (os.replace if replace else os.link)(staging, path)
        except FileNotFoundError:
            if attempt == _VANISHED_ATTEMPTS:
                raise
            continue  # the staging file was deleted under us: write it again
        finally:
            remove_staging(staging)  # after a link, or a failure
        directories = list(dict.fromkeys([os.path.dirname(path), *(os.path.dirname(d) for d in reversed(made))]))
        if fsync:
            for directory in directories:
                fsync_directory(directory)
        return directories
    raise AssertionError("unreachable: the last attempt returns or raises")


def remove_quietly(staging: str) -> None:
    """Remove a staging name; one that cannot be removed is left for garbage collection."""
    with contextlib.suppress(OSError):
        os.unlink(staging)


def fsync_file(path: str) -> None:
    """Make the bytes of the file at ``path`` durable (one ``write_durably`` wrote without
    fsync; the directories it returned need ``fsync_directory`` too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def start_writeback(path: str) -> None:
    """Ask the kernel to start writing the file at ``path`` to disk, without waiting for
    it: a later ``fsync_file`` then finds its bytes on their way. A hint only; a file that
    cannot be opened is left to that fsync to report."""
    if not hasattr(os, "posix_fadvise"):
        return  # no such hint here (macOS, Windows): the fsync does it all
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            # DONTNEED starts the writeback of the file's dirty pages (Linux) and then drops
            # only its clean ones: pages just written stay cached for a reader on this host.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _write_staging(
    path: str, data: Data, fsync: bool, opened: tuple[int, str] | None = None, size: int | None = None
) -> str:
    """A new staging file next to ``path`` (or ``opened``) holding ``data`` (fsynced when
    ``fsync``); its path."""
    fd, staging = opened or open_staging(path)
    try:
        _write_all(fd, data, size)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise
    os.close(fd)
    return staging


def _write_all(fd: int, data: Data, size: int | None = None) -> None:
    """Every byte of ``data`` (a buffer, or pieces written back to back with ``writev``:
    the object's one copy is the kernel's), ``size`` bytes when the caller knows. The
    pieces go to the kernel as they are, ``_IOV_MAX`` at a time (a pack of 16 TGBs of 32
    slices is about 1,600 pieces); only a write that stops short (rare: a signal, a full
    disk) views them again to go on."""
    pieces = data if isinstance(data, list) else [data]
    if not hasattr(os, "writev"):
        _write_rest(fd, pieces, 0)
        return
    if len(pieces) > _IOV_MAX:
        size = None  # counted per batch of pieces below
    for first in range(0, len(pieces), _IOV_MAX):
        batch = pieces[first : first + _IOV_MAX]
        written = os.writev(fd, batch)
        if written != (size if size is not None else _lengths(batch)):
            _write_rest(fd, batch, written)


def _lengths(batch: list[Buffer]) -> int:
    """The pieces' bytes, summed by builtins: a pack's ~1,600 pieces cost a Python call
    each before (0.5 ms a pack here). ``len`` counts bytes only for bytes objects; any
    other buffer is counted through a byte view of it."""
    if set(map(type, batch)) <= _BYTES_TYPES:
        return sum(map(len, batch))
    return sum(map(_NBYTES, map(memoryview, batch)))


_BYTES_TYPES = {bytes, bytearray}
_NBYTES = operator.attrgetter("nbytes")


def _write_rest(fd: int, data: list[Buffer], written: int) -> None:
    """The bytes of ``data`` after its first ``written``."""
    pieces = [memoryview(piece).cast("B") for piece in data]
    at = 0  # the first piece not wholly written (an index: popping the front is O(n))
    while True:
        while at < len(pieces) and written >= len(pieces[at]):
            written -= len(pieces[at])
            at += 1
        if at == len(pieces):
            return
        if written:
            pieces[at] = pieces[at][written:]
        batch = pieces[at : at + _IOV_MAX]
        written = os.writev(fd, batch) if hasattr(os, "writev") else os.write(fd, batch[0])


def open_staging(path: str) -> tuple[int, str]:
    """A new, empty staging file next to ``path``: its descriptor (open for writing) and path."""
    for _ in range(_STAGING_ATTEMPTS):
        staging = f"{path}#{secrets.randbelow(10**18):018d}"
        try:
            return os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), staging
        except FileExistsError:
            continue  # never to reach the caller: a lost create-only race says FileExistsError
    raise OSError(f"no free staging name next to {path} after {_STAGING_ATTEMPTS} random draws")


def make_dirs(directory: str) -> list[str]:
    """Make ``directory`` and its missing parents; the ones that were missing, top down.

    One that a racing put makes at the same moment counts as missing too, so that this
    put fsyncs its parent as well instead of returning before the other put has.
    """
    missing = []
    while not os.path.isdir(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    missing.reverse()
    for made in missing:
        with contextlib.suppress(FileExistsError):
            os.mkdir(made)
    return missing


def fsync_directory(directory: str) -> None:
    """Make the names in ``directory`` durable (what links, renames and mkdirs changed)."""
    if os.name == "nt":
        return  # a directory cannot be opened there; NTFS journals its names itself
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def find_staging(root: str) -> Iterator[ObjectInfo]:
    """Every staging file under ``root``, keyed relative to it."""
    pending = [root]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
                elif STAGING_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    try:
                        stat = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # its put just finished
                    key = os.path.relpath(entry.path, root).replace(os.sep, "/")
                    yield ObjectInfo(key=key, size=stat.st_size, modified_s=stat.st_mtime)
