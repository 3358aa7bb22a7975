"""A producer's pack writer: holds small TGBs for their pack, uploads packs, queues their
descriptors for commit.

``PackWriter.add`` takes a framed TGB (``layout.frame_tgb``) and either writes it at once
(a pack of one: no copy) or holds a copy for its pack (``batchweave.packing`` decides
which, and when a pack is due); a pack is encoded (``layout.encode_pack``) and uploaded
with create-only puts, its objects at once on an object store (a TGB of 1,250 slices is
20 objects: one round trip rather than 20), and its TGBs' descriptors join the pending
queue the commit thread commits. A pack begun while appends stop coming is written at its
deadline by a thread of its own. ``PackWriter`` is given the store, the state shared with
the commit thread, the producer's name, mesh, options and policy; nothing else of it.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

from batchweave.commit.policies import CommitPolicy
from batchweave.commit.shared import SharedState
from batchweave.errors import ObjectExistsError
from batchweave.keys import data_key
from batchweave.layout import FramedTGB, Piece, encode_pack
from batchweave.log import TGBDescriptor
from batchweave.mesh import Mesh
from batchweave.packing import Held, PackBuffer, pack_limit
from batchweave.store import Store
from batchweave.writing.options import ProducerOptions

__all__ = ["UPLOAD_THREADS", "PackWriter"]

_logger = logging.getLogger("batchweave.producer")  # the producer's messages, under the producer's name
UPLOAD_THREADS = 8  # a TGB's objects uploaded at once (a producer appends one TGB at a time)


class PackWriter:
    """Writes one producer's TGBs, alone or in packs (module doc).

    ``lock`` is held by ``add`` callers (the producer's ``append``, which checks the TGB
    under it), by ``write_held``, ``drop_held`` and a stalled pack's deadline: one writer
    of packs at a time, so TGBs reach ``pending`` in offset order.
    """

    def __init__(
        self,
        store: Store,
        shared: SharedState,
        mesh: Mesh,
        options: ProducerOptions,
        policy: CommitPolicy,
    ) -> None:
        self._store = store
        self._shared = shared
        self._mesh = mesh
        self._max_object_bytes = options.max_object_bytes
        self._pack_steps = options.pack_steps
        self._policy = policy
        self._background = options.background_commit  # a commit thread waits on shared.cond
        self._pack = PackBuffer(options.pack_delay_s)
        self.lock = threading.Lock()
        self._taken = threading.Event()  # set when the pack begun last is written
        self._uploads: ThreadPoolExecutor | None = None  # started by the first TGB of several objects
        # The pack watcher (``_watch_packs``): one thread, started with the first pack,
        # told of each pack begun (its generation and its ``taken``) through ``_begun``.
        self._begun = threading.Condition()
        self._watching: tuple[int, threading.Event] | None = None
        self._watcher: threading.Thread | None = None
        self._closed = False

    @property
    def held(self) -> int:
        """TGBs appended and held for their pack, not yet written."""
        return len(self._pack)

    def add(self, offset: int, framed: FramedTGB, schema_digest: str) -> None:
        """Under ``lock``: write the TGB at ``offset`` now, or hold a copy of it for its pack
        and write the pack if it is due. A failed write un-holds this TGB (the caller
        appends it again; the others stay held)."""
        limit, now = pack_limit(framed, self._pack_steps), time.monotonic()
        self._pack.appended(now)
        if not self._pack.fits(limit):
            self._write_pack()  # the held ones go first, alone: this TGB is not theirs to join
        if limit == 1 and not self._pack:
            self._write([Held(offset, framed, schema_digest)])  # written before append returns: no copy
            return
        self._pack.hold(Held(offset, framed.owned(), schema_digest), limit, now)
        if self._pack.due(now):
            try:
                self._write_pack()
            except BaseException:
                self._pack.drop_last()
                raise
        elif len(self._pack) == 1 and self._background:
            self._watch_deadline()

    def write_held(self) -> None:
        """Write the TGBs held for a pack now (a flush does this first)."""
        with self.lock:
            self._write_pack()

    def drop_held(self) -> None:
        """Forget the held TGBs (a close that did not flush them drops them, as pending
        ones are), and end a deadline's thread."""
        with self.lock:
            self._pack.take()
            self._taken.set()

    def close(self) -> None:
        """After the last write: end the upload threads and the pack watcher."""
        with self._begun:
            self._closed = True
            self._begun.notify()
        self._taken.set()
        if self._uploads is not None:
            self._uploads.shutdown(wait=True)

    def _write_pack(self) -> None:
        """Under ``lock``: write the held TGBs as one pack, then forget them."""
        if self._pack:
            self._write(list(self._pack.held))
            self._pack.take()
            self._taken.set()

    def _write(self, helds: list[Held]) -> None:
        """Upload consecutive TGBs as one pack and queue their descriptors for commit."""
        shared, producer_id = self._shared, self._shared.producer_id
        tgbs: list[FramedTGB] = [held.tgb for held in helds]
        pack = encode_pack(tgbs, self._max_object_bytes)
        token = secrets.token_hex(4)  # a retried write never collides with its own debris
        epoch, first = shared.me.epoch, helds[0].offset  # a pack is named by its first TGB
        keys = [data_key(producer_id, epoch, first, token, part) for part in range(len(pack.parts))]
        self._put_objects(list(zip(keys, pack.parts, pack.sizes, strict=True)))
        descriptors = [
            TGBDescriptor(
                producer=producer_id,
                epoch=epoch,
                source_offset=held.offset,
                dp=self._mesh.dp,
                cp=self._mesh.cp,
                kind=pack.kind,
                objects=keys,
                slices=refs,  # the log's tuples, made once by the layout
                nbytes=nbytes,
                schema=held.schema,
            )
            for held, refs, nbytes in zip(helds, pack.refs, pack.shares, strict=True)
        ]
        with shared.cond:
            shared.raise_if_unusable(self._store.url)
            before = len(shared.pending)
            shared.queue(descriptors, time.monotonic())
            shared.metrics["bytes_written"] += sum(pack.sizes)
            # A commit thread waits for its policy's gap; TGBs queued behind others bring
            # that forward only when the policy counts them (a count it waits for): else
            # waking it on every append cost both threads a hand-off of the interpreter
            # lock a TGB (15 futex calls a TGB at 100 KB, more than the put made).
            policy, after = self._policy, len(shared.pending)
            if not self._background or before == 0 or policy.wait_s(after, 0.0) < policy.wait_s(before, 0.0):
                shared.cond.notify_all()

    def _watch_deadline(self) -> None:
        """Have the pack watcher write the pack just begun at its deadline if appends stop
        coming (a stalled producer). One thread per producer, for all its packs: a thread
        started per pack cost a thread's start and end a pack (1,000-1,500 threads in a
        20 s window of 8 or 32 producers at 100 KB)."""
        self._taken = taken = threading.Event()
        with self._begun:
            self._watching = (self._pack.generation, taken)
            self._begun.notify()
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_packs, name="batchweave-pack", daemon=True)
            self._watcher.start()

    def _watch_packs(self) -> None:
        """The pack watcher's body: each pack begun, until it is written or its deadline
        passes (``_write_at_deadline``), until the writer closes. A pack begins only once
        the one before is written, so the newest begun is the only one to watch."""
        while True:
            with self._begun:
                while self._watching is None and not self._closed:
                    self._begun.wait()
                watching, self._watching = self._watching, None
                if self._closed or watching is None:
                    return
            generation, taken = watching
            self._write_at_deadline(generation, taken)

    def _write_at_deadline(self, generation: int, taken: threading.Event) -> None:
        while not taken.wait(max(0.0, self._pack.deadline() - time.monotonic())):
            with self.lock:
                if self._pack.generation != generation or self._shared.closed:
                    return
                if time.monotonic() < self._pack.deadline():
                    continue
                try:
                    self._write_pack()
                except Exception as exc:  # the TGBs stay held: the next append or flush writes them, or raises
                    _logger.warning(
                        "producer %r: writing a pack of %d held TGB(s) at its deadline failed; the next append "
                        "or flush tries again: %s",
                        self._shared.producer_id,
                        len(self._pack),
                        exc,
                    )
                return

    def _put_objects(self, uploads: list[tuple[str, list[Piece], int]]) -> None:
        """A pack's objects, all at once on an object store. Every upload has ended when
        this returns or raises (the first failure)."""
        if len(uploads) == 1 or not self._store.remote:
            for key, pieces, size in uploads:
                self._put_object(key, pieces, size)
            return
        if self._uploads is None:
            self._uploads = ThreadPoolExecutor(max_workers=UPLOAD_THREADS, thread_name_prefix="batchweave-upload")
        running = [self._uploads.submit(self._put_object, *upload) for upload in uploads]
        wait(running)
        for done in running:
            done.result()

    def _put_object(self, key: str, pieces: list[Piece], size: int) -> None:
        try:
            self._store.stage_if_absent(key, pieces, size)  # durable before the commit that names it
        except ObjectExistsError:
            # The key carries a fresh random token, so "exists" can only mean that a retry
            # followed our own write which the store applied before timing out.
            if self._store.size(key) != size:
                raise
