"""Namespaces never overlap (invariant I13): a namespace is not created inside another's
prefix, nor around one.

Two nested namespaces cannot be told apart by prefix alone: the outer one's listing of
``data/`` holds the inner one's objects. Collection deletes only keys of its own layout
(``lifecycle.gc``), so nothing is lost, but neither is such a pair sound, so the first
producer of a namespace refuses it (``refuse_overlap``, called from its claim while the
log has no version yet). It looks:

- above: the prefixes from the bucket or container (the file system's root for a local
  directory) down to this one's parent, one listing of ``<prefix>/_log/`` each, for a
  log version, a snapshot or the hint (``keys.is_namespace_marker``);
- below: one listing of this prefix, normally empty when a namespace is created, for a
  key of another namespace's log (``keys.nested_namespace``), stopped after
  ``BELOW_LIMIT`` keys (a WARNING then says the check was cut short).

So a creation costs one listing per level of its prefix plus one, once per producer
that starts before version 1 exists; nothing once the namespace exists, nothing per
commit. A memory store's URL is a store of its own: nothing to check. A prefix these
credentials may not list (an IAM policy that grants listing inside the namespace only,
``permissions``) is skipped, saying so at INFO. Two namespaces created at the very same
moment may both pass; collection still never deletes the other's objects.
"""

from __future__ import annotations

import logging

from batchweave import keys
from batchweave.errors import NamespaceOverlapError, StorePermissionError
from batchweave.log import LogState
from batchweave.store import Store
from batchweave.store.urls import child_url

__all__ = ["ABOVE_LIMIT", "BELOW_LIMIT", "refuse_overlap"]

_logger = logging.getLogger(__name__)

# Keys read of each prefix above: a namespace's log lists its versions first (in key
# order on an object store), so the first page says whether one is there.
ABOVE_LIMIT = 100
# Keys read below the new namespace's prefix: a fresh prefix holds a few (a pool's shard
# lists, a probe) at most; a prefix full of other things is checked this far.
BELOW_LIMIT = 10_000


def refuse_overlap(store: Store, state: LogState) -> None:
    """Raise NamespaceOverlapError, naming both URLs, if the namespace of ``store``, not
    created yet (``state`` has no version), would lie inside another one or around one;
    see the module doc for what it reads. At once for a namespace that exists."""
    if state.version > 0 or not store.may_nest:
        return
    for above in store.ancestors():
        if _holds_namespace(above, store):
            raise NamespaceOverlapError(store.url, above.url, inside=True)
    inner = _nested_namespace(store)
    if inner is not None:
        raise NamespaceOverlapError(store.url, inner, inside=False)


def _holds_namespace(above: Store, store: Store) -> bool:
    """Whether the prefix of ``above`` is a namespace's root: its log is there."""
    try:
        listed, _ = above.list_first(keys.LOG_PREFIX, ABOVE_LIMIT)
    except StorePermissionError as exc:
        _logger.info(
            "%s: could not check %s for a namespace around this one (%s); namespaces must not nest",
            store.url,
            above.url,
            exc.problem,
        )
        return False
    return any(keys.is_namespace_marker(info.key) for info in listed)


def _nested_namespace(store: Store) -> str | None:
    """The URL of a namespace below ``store``'s prefix, if its first keys show one."""
    listed, more = store.list_first("", BELOW_LIMIT)
    roots = sorted({root for info in listed if (root := keys.nested_namespace(info.key)) is not None})
    if roots:
        return child_url(store.url, roots[0])
    if more:
        _logger.warning(
            "%s: creating a namespace where %d or more objects already are; checked the first %d for "
            "another namespace inside this prefix (namespaces must not nest), not the rest",
            store.url,
            BELOW_LIMIT,
            BELOW_LIMIT,
        )
    return None
