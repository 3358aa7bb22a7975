"""``storage_options`` checked before any request: BatchWeave's own (``retry_deadline_s``,
``fsync``) and, for object stores, obstore's typed configuration of the store kind, so a
mistyped key is a ConfigError naming the valid ones instead of an option silently ignored.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.resources
import math
from typing import Any
from urllib.parse import urlparse

from batchweave.errors import ConfigError
from batchweave.store.urls import SCHEME_FAMILY

__all__ = ["RETRY_DEADLINE_OPTION", "check_storage_options", "obstore_options"]

# obstore documents each store's configuration as a TypedDict in its type stubs
# (obstore.store.S3Config, AzureConfig, GCSConfig, ClientConfig, RetryConfig): they exist
# for type checkers only, so the keys are read from the stubs' source, not hand-copied.
_TYPED_CONFIGS = {
    "s3": ("_store/_aws.pyi", "S3Config"),
    "az": ("_store/_azure.pyi", "AzureConfig"),
    "gs": ("_store/_gcs.pyi", "GCSConfig"),
    "client_options": ("_store/_client.pyi", "ClientConfig"),
    "retry_config": ("_store/_retry.pyi", "RetryConfig"),
    "backoff": ("_store/_retry.pyi", "BackoffConfig"),
}
# The prefixes of the environment variables a config key also goes by (AWS_REGION: region).
_KEY_PREFIXES = {"s3": ("aws_",), "az": ("azure_storage_", "azure_"), "gs": ("google_",)}
# What from_url takes besides config keys.
_CLIENT_KEYS = ("client_options", "credential_provider", "retry_config")
# Ours, for local directories: False skips the fsyncs of a put (throwaway namespaces).
_FSYNC = "fsync"
# BatchWeave's own storage options, for every kind of store; stripped before obstore.
RETRY_DEADLINE_OPTION = "retry_deadline_s"
_BATCHWEAVE_OPTIONS = (RETRY_DEADLINE_OPTION,)


@functools.cache
def _typed_config_keys(name: str) -> frozenset[str] | None:
    """The keys of one of obstore's typed configs (``"s3"``, ``"client_options"``, ...), or
    None if this obstore's stubs do not have it (obstore then checks the keys itself)."""
    stub, class_name = _TYPED_CONFIGS[name]
    try:
        tree = ast.parse(importlib.resources.files("obstore").joinpath(stub).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            annotated = (item.target for item in node.body if isinstance(item, ast.AnnAssign))
            return frozenset(target.id for target in annotated if isinstance(target, ast.Name)) or None
    return None


def check_storage_options(url: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """``options`` checked for the store kind of ``url`` (a normalized namespace URL).

    Every store takes BatchWeave's own ``retry_deadline_s`` (seconds a request that keeps
    failing with throttling, server errors or timeouts is retried: a positive number, 600
    by default); local directories also take ``fsync`` (True or False: whether a put
    returns only once durable). Neither reaches obstore. Object stores take obstore's
    config keys for their kind (``region``, ``endpoint``, ``account_name``, ...; also
    spelled as the environment variable, ``AWS_REGION``) plus ``client_options``,
    ``retry_config`` and ``credential_provider``; memory stores take nothing else. Returns
    them with config keys in obstore's spelling. Raises ConfigError naming the valid keys
    for anything else. Messages name keys and the types of values, never a value:
    options hold secrets.
    """
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ConfigError(f"{url}: storage_options must be a dict with string keys, got {_type_name(options)}")
    if not all(isinstance(key, str) for key in options):
        kinds = sorted({type(key).__name__ for key in options if not isinstance(key, str)})
        raise ConfigError(f"{url}: storage_options must be a dict with string keys, got keys of type {kinds}")
    out = {key: _checked_batchweave_option(url, key, options[key]) for key in _BATCHWEAVE_OPTIONS if key in options}
    rest = {key: value for key, value in options.items() if key not in _BATCHWEAVE_OPTIONS}
    if url.startswith("file:"):
        return {**out, **_checked_local_options(url, rest)}
    if _FSYNC in rest:
        durable = "it keeps nothing on disk" if url.startswith("memory:") else "a put is durable when it answers"
        raise ConfigError(f"{url}: storage option {_FSYNC!r} is for local directories only ({durable})")
    family = SCHEME_FAMILY.get(urlparse(url).scheme.lower())
    if family is None:
        if rest:
            raise ConfigError(
                f"{url}: a memory store takes no storage_options but BatchWeave's own "
                f"({', '.join(_BATCHWEAVE_OPTIONS)}), got {sorted(rest)}"
            )
        return out
    config = _typed_config_keys(family)
    for key, value in options.items():
        if key in _BATCHWEAVE_OPTIONS:
            continue
        if key in _CLIENT_KEYS:
            out[key] = _checked_client_option(url, key, value)
            continue
        name = _config_key(key, family, config)
        if name is None:
            valid = sorted(config or ()) + list(_CLIENT_KEYS) + list(_BATCHWEAVE_OPTIONS)
            near = difflib.get_close_matches(key.lower(), valid, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(
                f"{url}: unknown storage option {key!r}{hint}; valid for {family}:// stores: {', '.join(valid)}"
            )
        out[name] = value
    return out


def _checked_local_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options of a local directory: ``fsync`` only."""
    unknown = sorted(set(options) - {_FSYNC})
    if unknown:
        raise ConfigError(
            f"{url}: a local directory takes no storage_options but {_FSYNC!r} and BatchWeave's own "
            f"({', '.join(_BATCHWEAVE_OPTIONS)}), got {unknown}"
        )
    if _FSYNC in options and not isinstance(options[_FSYNC], bool):
        raise ConfigError(f"{url}: storage option {_FSYNC!r} must be True or False, got {_type_name(options[_FSYNC])}")
    return dict(options)


def _type_name(value: Any) -> str:
    """What a bad option value is, for a message: its type only (the value may be a secret)."""
    return f"a value of type {type(value).__name__}"


def _checked_batchweave_option(url: str, key: str, value: Any) -> Any:
    """A BatchWeave option's value, checked. The message names the key and the type, not
    the value: storage options sit next to secrets, and a mistake here must not print them."""
    if key == RETRY_DEADLINE_OPTION:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value > 0):
            why = "" if not number else " that is not finite" if not math.isfinite(value) else " that is not positive"
            shown = f"a value of type {type(value).__name__}{why}"
            raise ConfigError(
                f"{url}: storage option {key} must be a positive number of seconds (int or float), got {shown}"
            )
        return float(value)
    raise AssertionError(f"no check for BatchWeave option {key}")


def obstore_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` without BatchWeave's own, which obstore would refuse."""
    return {key: value for key, value in options.items() if key not in _BATCHWEAVE_OPTIONS}


def _config_key(key: str, family: str, config: frozenset[str] | None) -> str | None:
    """``key`` in obstore's spelling if it is a config key of ``family`` (None if not)."""
    lowered = key.lower()
    if config is None:
        return lowered  # no stubs to check against: obstore refuses unknown keys at the build
    if lowered in config:
        return lowered
    for prefix in _KEY_PREFIXES[family]:
        if lowered.startswith(prefix) and lowered[len(prefix) :] in config:
            return lowered[len(prefix) :]
    return None


def _checked_client_option(url: str, key: str, value: Any) -> Any:
    if key == "credential_provider":
        if not callable(value):
            raise ConfigError(f"{url}: storage option credential_provider must be callable, got {_type_name(value)}")
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{url}: storage option {key} must be a dict, got {_type_name(value)}")
    _check_keys(url, key, value, _typed_config_keys(key))
    if key == "retry_config" and isinstance(value.get("backoff"), dict):
        _check_keys(url, "retry_config['backoff']", value["backoff"], _typed_config_keys("backoff"))
    return dict(value)


def _check_keys(url: str, where: str, value: dict[str, Any], valid: frozenset[str] | None) -> None:
    if valid is None:
        return  # this obstore's stubs do not list the keys: obstore checks them itself
    unknown = sorted(key if isinstance(key, str) else f"<a {type(key).__name__}>" for key in value if key not in valid)
    if unknown:
        raise ConfigError(f"{url}: unknown keys {unknown} in storage option {where}; valid: {', '.join(sorted(valid))}")
