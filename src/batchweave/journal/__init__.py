"""The log on a store: the thin driver around the pure ``log`` model, used by every actor
(producers commit through it, readers follow it, the lifecycle collects with it).

``core`` is the ``Journal``: reading versions, catching up, loading the newest state and
the one commit loop (invariant I8); ``proof`` the anchor that proves a view genuine, for
writers and readers alike (I10); ``snapshots`` the snapshots and their hint, where a load
starts; ``segments`` the log segments a committer writes and readers read; ``objects``
the store as a journal reaches it, each request counted; ``namespace`` whether a URL
holds a namespace at all; ``overlap`` that a namespace being created lies neither inside
another nor around one (I13).
"""

from batchweave.journal.core import DEFAULT_SNAPSHOT_EVERY, Committed, Journal

__all__ = ["DEFAULT_SNAPSHOT_EVERY", "Committed", "Journal"]
