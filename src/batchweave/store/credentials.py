"""Credentials for S3 stores: the standard AWS chain, resolved (or refused) before the
first request rather than discovered missing by a request that times out."""

from __future__ import annotations

import functools
import os
import socket
import threading
from typing import Any
from urllib.parse import urlparse

from batchweave.errors import ConfigError

__all__ = ["s3_credentials"]

_AWS_KEYS_SET = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary credentials)"
_METADATA_ENDPOINT = "http://169.254.169.254"


def s3_credentials(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with a credential provider for the standard AWS chain, or unchanged.

    Keys in the options or the environment go to obstore as they are (the chain's first
    link). Otherwise, with boto3 installed, boto3 resolves the chain (profiles, SSO,
    ``~/.aws``, web identity, container and instance roles); without it obstore does
    (web identity, container and instance roles). Either way a chain that cannot give
    credentials is a ConfigError now, before the first request, not a request to the
    instance metadata endpoint that times out minutes later.
    """
    given = {key for key in options if key != "retry_config"} | {
        key[4:].lower() for key in os.environ if key.startswith("AWS_")
    }
    if given & {"credential_provider", "access_key_id", "skip_signature"}:
        return options
    try:
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        _require_obstore_chain(url, given, options)
        return options
    try:
        provider = _boto3_provider(Boto3CredentialProvider)
    except Exception as exc:  # botocore's ProfileNotFound, SSO token expired, no credentials...
        raise ConfigError(f"{url}: {_no_aws_credentials(exc)}") from exc
    return {**options, "credential_provider": provider}


def _boto3_provider(provider_class: Any) -> Any:
    """One provider per process and AWS environment: a boto3 session costs ~50 ms to make,
    and its credentials refresh themselves."""
    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    key = (os.getpid(), environment)
    with _providers_lock:
        provider = _providers.get(key)
        if provider is None:
            import boto3

            provider = _providers[key] = provider_class(boto3.Session())
    return provider


_providers: dict[tuple[int, tuple[tuple[str, str], ...]], Any] = {}
_providers_lock = threading.Lock()


def _no_aws_credentials(exc: BaseException | None) -> str:
    found = "boto3 found no AWS credentials" if isinstance(exc, ValueError) else f"AWS credentials: {exc}"
    return (
        f"{found}. Set {_AWS_KEYS_SET}, or AWS_PROFILE naming a profile in ~/.aws/config "
        "(`aws sso login --profile NAME` for SSO), or run on a machine with an instance, container or "
        "web-identity role; for a public bucket pass storage_options={'skip_signature': True}"
    )


def _require_obstore_chain(url: str, given: set[str], options: dict[str, Any]) -> None:
    """Without boto3: obstore's own chain needs web identity, a container role, or an
    instance role it reaches through the metadata endpoint; refuse when none can work."""
    if {"web_identity_token_file", "container_credentials_relative_uri", "container_credentials_full_uri"} & given:
        return
    disabled = os.environ.get("AWS_EC2_METADATA_DISABLED", "").strip().lower() == "true"
    endpoint = str(options.get("metadata_endpoint") or os.environ.get("AWS_METADATA_ENDPOINT") or _METADATA_ENDPOINT)
    if not disabled and _reachable(endpoint):
        return
    where = "instance metadata is disabled (AWS_EC2_METADATA_DISABLED)" if disabled else f"{endpoint} does not answer"
    raise ConfigError(
        f"{url}: no AWS credentials: none in the environment and no instance role ({where}). Set "
        f"{_AWS_KEYS_SET}, or AWS_ROLE_ARN with AWS_WEB_IDENTITY_TOKEN_FILE; profiles, SSO and ~/.aws "
        "are read only with boto3 installed (pip install 'batchweave[s3]')"
    )


@functools.cache
def _reachable(endpoint: str, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection to ``endpoint`` opens within ``timeout_s`` (once per process)."""
    parsed = urlparse(endpoint)
    try:
        with socket.create_connection((parsed.hostname or "", parsed.port or 80), timeout=timeout_s):
            return True
    except OSError:
        return False
