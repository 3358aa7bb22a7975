"""One error root, matching built-in bases, and the one place that translates obstore errors."""

from __future__ import annotations

import builtins
import inspect
import re

import pytest
from obstore_errors import obstore_status_message, obstore_transport_message

import batchweave
from batchweave import errors
from batchweave.errors import (
    BatchWeaveError,
    ConfigError,
    CorruptDataError,
    LayoutError,
    ObjectExistsError,
    ObjectNotFoundError,
    ProducerFencedError,
    SourceOffsetError,
    StepTimeoutError,
    StoreError,
    StorePermissionError,
    StreamEndedError,
    TransientStoreError,
)

ERROR_CLASSES = [getattr(errors, name) for name in errors.__all__]


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_is_a_batchweave_error(cls):
    assert inspect.isclass(cls)
    assert issubclass(cls, BatchWeaveError)
    assert issubclass(cls, Exception)


def test_all_lists_every_error_class_in_the_module():
    defined = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == errors.__name__
    }
    assert defined == set(errors.__all__)


@pytest.mark.parametrize(
    "cls,builtin",
    [
        (ObjectNotFoundError, FileNotFoundError),
        (ObjectExistsError, FileExistsError),
        (LayoutError, ValueError),
        (ConfigError, ValueError),
        (CorruptDataError, ValueError),
        (SourceOffsetError, ValueError),
        (StepTimeoutError, TimeoutError),
        (StorePermissionError, PermissionError),
        (TransientStoreError, ConnectionError),
        (errors.NotDurableError, OSError),
    ],
)
def test_documented_builtin_bases(cls, builtin):
    assert issubclass(cls, builtin)


@pytest.mark.parametrize("cls", [ObjectNotFoundError, ObjectExistsError, StorePermissionError, TransientStoreError])
def test_store_errors_under_store_error(cls):
    assert issubclass(cls, StoreError)


def test_non_store_errors_are_not_store_errors():
    for cls in (
        ConfigError,
        LayoutError,
        SourceOffsetError,
        CorruptDataError,
        ProducerFencedError,
        StreamEndedError,
        StepTimeoutError,
    ):
        assert not issubclass(cls, StoreError)


def test_except_builtin_catches_ours():
    with pytest.raises(FileNotFoundError):
        raise ObjectNotFoundError("k", "no such object")
    with pytest.raises(ValueError):
        raise CorruptDataError("k", "bad")


def test_keyed_errors_carry_key_and_problem():
    for cls in (CorruptDataError, StoreError, ObjectNotFoundError, TransientStoreError):
        exc = cls("data/p/x.bwb", "what went wrong")
        assert exc.key == "data/p/x.bwb"
        assert exc.problem == "what went wrong"
        assert "data/p/x.bwb" in str(exc) and "what went wrong" in str(exc)


def test_docstring_tree_names_every_class():
    doc = errors.__doc__
    assert doc
    drawn = set(re.findall(r"\b([A-Z][A-Za-z]+Error)\b", doc))
    assert set(errors.__all__) <= drawn
    # Each drawn class exists (no stale names in the picture).
    assert drawn - {
        "FileNotFoundError",
        "FileExistsError",
        "ValueError",
        "TimeoutError",
        "PermissionError",
        "ConnectionError",
        "LookupError",
        "OSError",
    } <= set(errors.__all__)


def test_docstring_tree_matches_the_class_hierarchy():
    # Each tree line is "<indent>├── Name (Builtin)  comment"; the indent gives the parent.
    stack: list[tuple[int, type]] = []
    checked = 0
    for line in errors.__doc__.splitlines():
        found = re.search(r"\b([A-Z][A-Za-z]+Error)\b(?: \(([A-Z][A-Za-z]+Error)\))?", line)
        if not found or found.group(1) not in errors.__all__:
            continue
        column = found.start(1)
        cls = getattr(errors, found.group(1))
        while stack and stack[-1][0] >= column:
            stack.pop()
        if stack:
            assert cls.__bases__[0] is stack[-1][1], f"{cls.__name__} drawn under {stack[-1][1].__name__}"
            checked += 1
        if found.group(2):
            assert issubclass(cls, getattr(builtins, found.group(2)))
        stack.append((column, cls))
    assert checked == len(errors.__all__) - 1  # everything but the root hangs under a parent


def test_errors_reexported_at_top_level():
    for name in errors.__all__:
        assert getattr(batchweave, name) is getattr(errors, name)
        assert name in batchweave.__all__


# -- translate_error -------------------------------------------------------------------

obs_errors = pytest.importorskip("obstore.exceptions")
store = pytest.importorskip("batchweave.store")


@pytest.mark.parametrize(
    "make,want",
    [
        (lambda: obs_errors.NotFoundError("Object at location x not found"), ObjectNotFoundError),
        (lambda: obs_errors.AlreadyExistsError("Object at location x already exists"), ObjectExistsError),
        (lambda: obs_errors.PreconditionError("Request precondition failure"), ObjectExistsError),
        (lambda: obs_errors.PermissionDeniedError("403 Forbidden AccessDenied"), StorePermissionError),
        (lambda: obs_errors.UnauthenticatedError("401 Unauthorized"), StorePermissionError),
        (
            lambda: obs_errors.GenericError(obstore_status_message("the/key", 503, code="SlowDown")),
            TransientStoreError,
        ),
        (
            lambda: obs_errors.GenericError(obstore_transport_message("the/key", "Interrupted")),
            TransientStoreError,
        ),
        (lambda: TimeoutError("timed out"), TransientStoreError),
        (lambda: ConnectionError("refused"), TransientStoreError),
        (lambda: FileNotFoundError("gone"), ObjectNotFoundError),
    ],
    ids=[
        "notfound",
        "exists",
        "precondition",
        "denied",
        "unauthenticated",
        "slowdown",
        "reset",
        "timeout",
        "connection",
        "filenotfound",
    ],
)
def test_translate_error(make, want):
    exc = make()
    got = store.translate_error(exc, "the/key", conditional=True)  # a conflict is a lost race only here
    assert type(got) is want
    assert got.key == "the/key"
    assert "the/key" in str(got)


def test_translate_unknown_error_is_plain_store_error():
    got = store.translate_error(obs_errors.GenericError("400 Bad Request: something odd"), "k")
    assert type(got) is StoreError


def test_conditional_conflict_only_when_conditional():
    exc = obs_errors.GenericError("Client error with status 409 Conflict: ConditionalRequestConflict")
    assert type(store.translate_error(exc, "k", conditional=True)) is ObjectExistsError
    unconditional = store.translate_error(exc, "k", conditional=False)
    assert not isinstance(unconditional, ObjectExistsError)
    assert isinstance(unconditional, StoreError)
    assert type(store.translate_error(exc, "k")) is not ObjectExistsError


def test_translate_error_keeps_first_line_of_message():
    exc = obs_errors.GenericError("503 SlowDown first line\nsecond line with details")
    got = store.translate_error(exc, "k")
    assert "first line" in str(got)
    assert "second line" not in str(got)


def test_data_reclaimed_error_names_the_step_and_the_oldest_available():
    error = errors.DataReclaimedError("memory://x", 5, 15)
    assert isinstance(error, LookupError) and isinstance(error, errors.BatchWeaveError)
    assert (error.step, error.oldest) == (5, 15) and "step 5" in str(error) and "15" in str(error)
