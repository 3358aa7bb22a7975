"""Whether a URL holds a namespace at all: the rule the tools that only read or tidy a
namespace (``inspect``, ``gc``, ``release_checkpoint``) use to tell one from a mistyped URL."""

from __future__ import annotations

from batchweave.errors import ConfigError
from batchweave.log import LogState
from batchweave.store import Store

__all__ = ["no_namespace_message", "require_namespace"]


def require_namespace(store: Store, state: LogState, *, has_checkpoints: bool) -> None:
    """Refuse a namespace that does not exist, for the tools that only read or tidy one.

    A local directory exists or not (``open_store(create=False)`` refuses a missing one).
    On an object store a prefix always "exists", so a namespace exists once something was
    committed there (log version 1 or a snapshot: ``state.version > 0``) or a checkpoint
    was marked there. Anything else is most likely a mistyped URL. (A ``Consumer`` does not
    ask: on an object store it may start before the first producer and wait; it warns
    meanwhile. ``batchweave inspect`` says the same of a local directory with nothing in it.)
    """
    if store.object_store and state.version == 0 and not has_checkpoints:
        raise ConfigError(no_namespace_message(store.url))


def no_namespace_message(url: str) -> str:
    """What the tools say of a URL where nothing was committed yet (a waiting consumer too)."""
    return (
        f"no BatchWeave namespace at {url}: nothing committed yet (no log version 1, no snapshot, no checkpoint "
        "marked); check the URL, prefix included, against the producers' one, or start the producers first"
    )
