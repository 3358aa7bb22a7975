"""The public API is exported on purpose (httpx's tests/test_exported_members.py)."""

from __future__ import annotations

import inspect
import types

import batchweave


def _isort_style_key(name: str) -> tuple[int, str]:
    # The order `__all__` uses (isort / ruff RUF022 style): SCREAMING_CASE constants first,
    # then CamelCase classes, then everything else; case-sensitive within each group.
    if name.isupper():
        group = 0
    elif name[:1].isupper():
        group = 1
    else:
        group = 2
    return group, name


def test_all_is_sorted():
    names = list(batchweave.__all__)
    assert names == sorted(names, key=_isort_style_key)


def test_all_has_no_duplicates():
    names = list(batchweave.__all__)
    assert len(names) == len(set(names))


def test_all_names_exist():
    missing = [name for name in batchweave.__all__ if not hasattr(batchweave, name)]
    assert missing == []


def test_every_public_class_and_function_is_exported():
    exported = set(batchweave.__all__)
    public = {
        name
        for name, value in vars(batchweave).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", "").split(".")[0] == "batchweave"
    }
    assert public, "found no public members at all"
    assert public - exported == set()


def test_version_is_exported_string():
    assert "__version__" in batchweave.__all__
    assert isinstance(batchweave.__version__, str) and batchweave.__version__


def test_exports_are_defined_in_batchweave():
    for name in batchweave.__all__:
        value = getattr(batchweave, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert value.__module__.startswith("batchweave."), name
