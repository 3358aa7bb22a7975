"""obstore's errors translated into BatchWeave's: the one place that knows them.

``translate_error`` maps a failed request's exception to a ``StoreError`` (a lost race, a
missing object or bucket, a denial naming the permission to grant or saying the key is
wrong, a plain-HTTP endpoint that was not allowed, a transient failure, or a plain
failure), each saying what to do about it; ``translate_open_error`` the failure to build
a store to a ``ConfigError`` without the secrets of its options. ``throttling`` and ``never_reached`` tell the retry
loop what kind of failure it saw.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlparse

from obstore import exceptions as obs_errors

from batchweave.errors import (
    ConfigError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
    StorePermissionError,
    TransientStoreError,
)
from batchweave.store.urls import SCHEME_FAMILY

__all__ = ["never_reached", "required_permission", "throttling", "translate_error", "translate_open_error"]

# An error is classified by its type and, for obstore's generic HTTP errors, by the HTTP
# status obstore reports, never by words found anywhere in the message: the message holds
# the object's URL and the server's body, so a key like `_log/00000000000000000409.json`
# or `.../00503.json` must not read as a lost race or an outage.
#
# obstore 0.12 keeps the status only in the text: its message is the Rust error's Display,
# then "\n\nDebug source:\n" and the pretty-printed Debug of the error tree, e.g.
#     ... - Server returned non-2xx status code: 503 Service Unavailable: <body>
#     Debug source:
#     Generic {
#         store: "S3",
#         source: RetryError(
#             RetryErrorImpl {
#                 method: PUT,
#                 uri: Some(
#                     http://host/bucket/prefix/_log/00000000000000000409.json,
#                 ),
#                 ...
#                 inner: Status {          (or Response {, or Http(HttpError { kind: Timeout, ...)
#                     status: 503,
#                     body: Some("<Error>...</Error>"),
# In the Debug part every path and body is a quoted, escaped string and the URI is
# percent-encoded (no spaces, no newlines): once the quoted strings and URIs are dropped,
# no copy of the key is left, and a line that is exactly `status: NNN,` can only be the
# status field.
#
# The store's error code (NoSuchBucket, SignatureDoesNotMatch) is read the same way: from
# the Debug part's `body: Some(\n "<escaped body>",` line, whose quoted string holds the
# server's XML answer. A key or message inside that XML is XML-escaped by the server, so
# the body's first `<Code>` tag is the error code and nothing a key can forge; and no
# quoted path or percent-encoded URI can start a line of the Debug part.

# A create-only put that lost: S3 and SeaweedFS answer 412, S3 also 409 ConditionalRequestConflict.
_RACE_STATUSES = frozenset({409, 412})
# Throttling, server errors and request timeouts: the same request may succeed later.
_TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Of those, the ones a store answers when it wants fewer requests (the request-rate
# limiter slows down for them), and the codes that say so in a 200's error body.
_THROTTLING_STATUSES = frozenset({429, 503})
_THROTTLING_CODES = frozenset({"SlowDown", "ServerBusy", "TooManyRequests", "RequestLimitExceeded"})
# object_store's HttpErrorKind values for a request that never got an answer: connect
# failures, dropped connections, timeouts (Decode and Unknown are not known to be transient).
_TRANSIENT_HTTP_KINDS = frozenset({"Connect", "Request", "Timeout", "Interrupted"})
# A request hyper cancelled before sending it: the pooled connection it was given had been
# closed by the server (a keep-alive connection reset between requests, as load balancers
# do), "connection was not ready". object_store leaves its kind Unknown; nothing was sent.
_DEBUG_CANCELED = re.compile(r"^\s*source: hyper_util::client::legacy::Error\(\n\s*Canceled,$", re.MULTILINE)

_DEBUG_SEPARATOR = "\n\nDebug source:\n"
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_URI = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://\S+")
_DEBUG_STATUS = re.compile(r"^\s*status: (\d{3}),$", re.MULTILINE)
_DEBUG_HTTP_KIND = re.compile(r"HttpError \{\n\s*kind: (\w+),$", re.MULTILINE)
# `inner: Response {`: a 200 whose body says InternalError or SlowDown, which obstore
# treats as a 5xx (it already retried it).
_DEBUG_ERROR_BODY = re.compile(r"^\s*inner: Response \{$", re.MULTILINE)
# Without a Debug part (older obstore, or an error built by hand), the Display's status
# field: "Server returned non-2xx status code: 503 ..." (object_store 0.11+) or
# "Client error with status 409 ..." (object_store 0.10).
_DISPLAY_STATUS = re.compile(r"(?:Server returned (?:non-2xx status code: )?|Client error with status )(\d{3})\b")
# The error code of an S3 or Azure XML body (NoSuchBucket, SlowDown), anywhere in the text:
# for messages only, when there is no Debug part to read it from.
_BODY_CODE = re.compile(r"<Code>(\w+)</Code>")
# The answer's body in the Debug part (a quoted string, escapes and all; read before the
# quoted strings are dropped), and the URI the request went to.
_DEBUG_BODY = re.compile(r'^\s*body: Some\(\n\s*("(?:[^"\\]|\\.)*"),$', re.MULTILINE)
_DEBUG_URI = re.compile(r"^\s*uri: Some\(\n\s*(\S+),$", re.MULTILINE)
# reqwest's refusal to send to an http:// URL when the client allows only HTTPS (obstore's
# default: `allow_http` is off), as a structured field of the Debug part.
_DEBUG_PLAIN_HTTP = re.compile(r"^\s*kind: Builder,\n\s*source: BadScheme,$", re.MULTILINE)
# obstore deletes S3 objects with DeleteObjects, which answers 200 and reports each key's
# failure in the body: `DeleteFailed { path: "...", code: "AccessDenied", ... }` in the
# Debug part (read before its quoted strings are dropped; the path's quotes are escaped).
_DEBUG_DELETE_CODE = re.compile(r'DeleteFailed \{\n\s*path: "(?:[^"\\]|\\.)*",\n\s*code: "(\w+)",$', re.MULTILINE)


@dataclass(frozen=True, slots=True)
class _Failure:
    """What obstore's message says about a failed request, read from its structured fields."""

    status: int | None = None  # the HTTP status, if the server answered
    transport: str | None = None  # object_store's HttpErrorKind, if it did not
    error_body: bool = False  # a 2xx whose body was an S3 error (InternalError, SlowDown)
    code: str = ""  # the body's error code, for messages
    denied: bool = False  # a bulk delete that answered 200 and refused the key (AccessDenied)
    store_code: str = ""  # the error code read from the answer's body in the Debug part
    plain_http_refused: bool = False  # an http:// endpoint the client was not allowed to use
    endpoint: str = ""  # scheme://host:port the request went to, if the Debug part says
    canceled: bool = False  # hyper cancelled the request before sending it (a reset connection)

    def answer(self) -> str:
        """`` (HTTP 412 PreconditionFailed)``, or as much of it as is known."""
        said = " ".join(part for part in (f"HTTP {self.status}" if self.status else "", self.code) if part)
        return f" ({said})" if said else ""


def _failure_of(exc: BaseException, key: str) -> _Failure:
    text = str(exc)
    found_code = _BODY_CODE.search(text)
    code = found_code.group(1) if found_code else ""
    display, separator, debug = text.partition(_DEBUG_SEPARATOR)
    if separator:
        deleted = _DEBUG_DELETE_CODE.search(debug)
        body = _DEBUG_BODY.search(debug)
        body_code = _BODY_CODE.search(body.group(1)) if body else None
        store_code = deleted.group(1) if deleted else body_code.group(1) if body_code else ""
        code = store_code or code
        uri = _DEBUG_URI.search(debug)
        # Quoted strings first (a URI inside a body goes with it), then the bare URIs:
        # together they hold every copy of the key in the Debug part.
        debug = _URI.sub("<uri>", _QUOTED.sub('""', debug))
        status = _DEBUG_STATUS.search(debug)
        kind = _DEBUG_HTTP_KIND.search(debug)
        return _Failure(
            status=int(status.group(1)) if status else None,
            transport=kind.group(1) if kind else None,
            error_body=_DEBUG_ERROR_BODY.search(debug) is not None,
            code=code,
            denied=deleted is not None and deleted.group(1) == "AccessDenied",
            store_code=store_code,
            plain_http_refused=_DEBUG_PLAIN_HTTP.search(debug) is not None,
            endpoint=_endpoint_of(uri.group(1)) if uri else "",
            canceled=_DEBUG_CANCELED.search(debug) is not None,
        )
    # The Display part names the key raw ("Object at location <key> not found: ..."), in
    # the URI (percent-encoded) and in the body: drop the key, then the URIs.
    for form in {key, quote(key, safe="/")} - {""}:
        display = display.replace(form, "<key>")
    status = _DISPLAY_STATUS.search(_URI.sub("<uri>", display))
    return _Failure(status=int(status.group(1)) if status else None, code=code)


def _endpoint_of(uri: str) -> str:
    parts = urlparse(uri)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else ""


# The permission each request kind needs, per store family: a denial names the one to
# grant (docs/guides/permissions.md). A HEAD needs what a GET needs on all three.
_AZURE_BLOBS = "Microsoft.Storage/storageAccounts/blobServices/containers/blobs"
_PERMISSIONS = {
    "s3": {
        "get": "s3:GetObject",
        "head": "s3:GetObject",
        "put": "s3:PutObject",
        "delete": "s3:DeleteObject",
        "list": "s3:ListBucket",
    },
    "az": {
        "get": f"{_AZURE_BLOBS}/read",
        "head": f"{_AZURE_BLOBS}/read",
        "put": f"{_AZURE_BLOBS}/write",
        "delete": f"{_AZURE_BLOBS}/delete",
        "list": f"{_AZURE_BLOBS}/read",
    },
    "gs": {
        "get": "storage.objects.get",
        "head": "storage.objects.get",
        "put": "storage.objects.create",
        "delete": "storage.objects.delete",
        "list": "storage.objects.list",
    },
}
_REQUEST_WORDS = {"get": "read", "head": "read", "put": "write", "delete": "delete", "list": "list"}


def required_permission(request: str, store: str = "") -> str:
    """The permission a ``request`` ("get", "put", "delete", "list", "head") needs on the
    store of URL ``store`` ("s3:PutObject"); for a local directory, the request itself."""
    family = SCHEME_FAMILY.get(urlparse(store).scheme, "")
    return _PERMISSIONS.get(family, {}).get(request, request)


def _denied(key: str, request: str, store: str, failure: _Failure, detail: str) -> StorePermissionError:
    """A denial that names the refused request and the permission it needs."""
    answer = failure.answer()
    if not request:
        return StorePermissionError(key, f"access denied, check credentials{answer}: {detail}")
    action = required_permission(request, store)
    if action == request:  # a local directory: the operating system refused
        lacks = f"this process may not {_REQUEST_WORDS.get(request, request)} it"
    else:
        lacks = f"these credentials lack {action} on this {'prefix' if request == 'list' else 'key'}"
        if failure.status and not failure.code:
            # A HEAD's answer has no body: a wrong key or secret looks the same.
            lacks += " (or the access key or secret is wrong: the answer carried no error code to tell)"
    return StorePermissionError(
        key,
        f"access denied{answer} to {request}: {lacks} (docs/guides/permissions.md lists what each role needs): "
        f"{detail}",
        action=action,
    )


# A 404 for the bucket or container rather than the object: S3's and Azure's codes.
_NO_BUCKET_CODES = frozenset({"NoSuchBucket", "ContainerNotFound"})
# Credentials the store does not accept (not a permission they lack): S3's unknown key
# and wrong secret (403), Azure's failed Shared Key or SAS signature (403), and a session
# token that expired or was never valid (S3 answers those with 400).
_BAD_CREDENTIAL_CODES = {
    "InvalidAccessKeyId": "the access key or secret is wrong (the store knows no such access key id)",
    "SignatureDoesNotMatch": "the access key or secret is wrong (the request's signature, made with the secret, "
    "does not match the one the store computed)",
    "AuthenticationFailed": "the account key or SAS token is wrong (the store could not authenticate the request)",
    "ExpiredToken": "the session token has expired: get fresh credentials (aws sso login, a new role session)",
    "TokenRefreshRequired": "the session token has expired: get fresh credentials (aws sso login, a new role session)",
    "InvalidToken": "the session token is not valid: check AWS_SESSION_TOKEN or the profile's credentials",
}
# Where each store family's credentials come from, for the message that says they are wrong.
_CREDENTIAL_SOURCES = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE and ~/.aws/credentials, or storage_options "
    "access_key_id and secret_access_key)",
    "az": "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_KEY (or the same "
    "storage_options)",
    "gs": "GOOGLE_SERVICE_ACCOUNT or GOOGLE_APPLICATION_CREDENTIALS",
}
# What creates a missing bucket or container, per store family.
_MAKE_BUCKET = {
    "s3": ("bucket", "aws s3 mb s3://{name}"),
    "az": ("container", "az storage container create --name {name}"),
    "gs": ("bucket", "gcloud storage buckets create gs://{name}"),
}


def _family(store: str) -> str:
    return SCHEME_FAMILY.get(urlparse(store).scheme, "")


def _no_bucket(store: str, answer: str) -> str:
    """A 404 for the bucket: name it and say how to make it (BatchWeave never does)."""
    kind, command = _MAKE_BUCKET.get(_family(store), ("bucket", ""))
    name = urlparse(store).netloc.split("@")[0]  # abfs://container@account.dfs.core.windows.net
    if not name:
        return f"the {kind} does not exist{answer}: create it, or fix the URL; BatchWeave never creates {kind}s"
    make = f" ({command.format(name=name)})" if command else ""
    return (
        f"the {kind} {name!r} of {store} does not exist{answer}: create it{make}, or fix the {kind} name in the URL; "
        f"BatchWeave never creates {kind}s"
    )


def _bad_credentials(code: str, store: str, answer: str, detail: str) -> str:
    """A 403 for credentials the store rejects: which ones to check, not a permission to grant."""
    sources = _CREDENTIAL_SOURCES.get(_family(store), "the store's credentials")
    return (
        f"access denied{answer}: {_BAD_CREDENTIAL_CODES[code]}; check {sources}. "
        f"No permission to grant fixes this. The store's answer: {detail}"
    )


def _plain_http_refused(endpoint: str, store: str) -> str:
    """A request to an http:// endpoint that the client was not allowed to send."""
    where = endpoint or "the endpoint"
    allow = "set AWS_ALLOW_HTTP=true or " if _family(store) == "s3" else ""
    return (
        f"{where} is a plain-HTTP endpoint, which the store client refuses unless told to allow it: "
        f"{allow}pass storage_options={{'client_options': {{'allow_http': True}}}} (plain HTTP only for a "
        "test server on a trusted network; otherwise use the https:// endpoint)"
    )


def translate_error(
    exc: BaseException, key: str, *, conditional: bool = False, request: str = "", store: str = ""
) -> StoreError:
    """Map an obstore exception to ours. The one place that knows obstore's errors.

    ``conditional`` says the request was a create-only put: only then does a conflict
    (obstore's AlreadyExists or Precondition, HTTP 409 or 412) mean that the put lost
    to another writer; on any other request it is a plain ``StoreError``. ``request``
    ("get", "put", "delete", "list", "head") and ``store`` (the namespace URL) let a
    denial name the permission that is missing, and a missing bucket its name.

    The store's error code in the answer's body tells a missing bucket from a missing
    object (``NoSuchBucket``, ``ContainerNotFound``) and credentials the store rejects
    from a permission they lack (``SignatureDoesNotMatch``, ``InvalidAccessKeyId``,
    ``AuthenticationFailed``: a StorePermissionError whose ``action`` is "").
    """
    failure = _failure_of(exc, key)
    status, answer = failure.status, failure.answer()
    detail = _first_line(f"{type(exc).__name__}: {exc}")
    if (
        isinstance(exc, (obs_errors.AlreadyExistsError, obs_errors.PreconditionError, FileExistsError))
        or status in _RACE_STATUSES
    ):
        if conditional:
            return ObjectExistsError(key, f"already exists, the create-only put lost{answer}")
        return StoreError(key, f"conflict on a request that was not a create-only put{answer}: {detail}")
    if isinstance(exc, (obs_errors.NotFoundError, FileNotFoundError)) or status == 404:
        if failure.store_code in _NO_BUCKET_CODES:
            return ObjectNotFoundError(key, _no_bucket(store, answer))
        return ObjectNotFoundError(key, f"no such object{answer}")
    if failure.store_code in _BAD_CREDENTIAL_CODES:  # a 403, or a 400 for an expired token
        return StorePermissionError(key, _bad_credentials(failure.store_code, store, answer, detail))
    if (
        isinstance(exc, (obs_errors.PermissionDeniedError, obs_errors.UnauthenticatedError, PermissionError))
        or status in (401, 403)
        or failure.denied
    ):
        return _denied(key, request, store, failure, detail)
    if failure.plain_http_refused:
        return StoreError(key, _plain_http_refused(failure.endpoint, store))
    if isinstance(exc, (obs_errors.UnknownConfigurationKeyError, obs_errors.InvalidPathError)):
        return StoreError(key, f"bad store configuration or key ({detail})")
    if isinstance(exc, obs_errors.NotSupportedError):
        return StoreError(key, f"the store does not support this request ({detail})")
    if (
        isinstance(exc, (TimeoutError, ConnectionError))
        or status in _TRANSIENT_STATUSES
        or failure.transport in _TRANSIENT_HTTP_KINDS
        or failure.error_body
        or failure.canceled
    ):
        return TransientStoreError(key, f"store unavailable after retries{answer}: {detail}")
    return StoreError(key, f"request failed{answer}: {detail}")


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line[:300]


def throttling(exc: BaseException, key: str) -> bool:
    """Whether a failed request was answered with throttling (S3's 503 SlowDown, Azure's
    503 ServerBusy, GCS's 429): the store asks for fewer requests."""
    failure = _failure_of(exc, key)
    return failure.status in _THROTTLING_STATUSES or (failure.error_body and failure.code in _THROTTLING_CODES)


def never_reached(exc: BaseException) -> bool:
    """Whether a failed request never reached a server: connection refused, no such
    host, a TLS handshake that failed (object_store's ``Connect`` kind)."""
    return isinstance(exc, ConnectionRefusedError) or _failure_of(exc, "").transport == "Connect"


def translate_open_error(exc: BaseException, url: str, options: dict[str, Any]) -> ConfigError:
    """The ConfigError for a store obstore could not build from ``url`` and ``options``:
    the first line of its message, with every option value in it redacted (obstore quotes
    a value it cannot parse, 'failed to parse "..." as boolean': a session token given as
    skip_signature would be printed). The caller raises it ``from None``: a traceback
    would print the cause's message too."""
    return ConfigError(f"cannot open {url!r}: {_redacted(_first_line(str(exc)), options)}")


def _redacted(text: str, options: dict[str, Any], where: str = "") -> str:
    """``text`` with every string value of ``options`` (nested dicts too) replaced by
    ``<value of KEY>``. Values under 4 characters stay: no secret is that short, and
    replacing them would garble the message."""
    for key, value in options.items():
        name = f"{where}{key}"
        if isinstance(value, dict):
            text = _redacted(text, value, f"{name}.")
        elif isinstance(value, str) and len(value) >= 4:
            text = text.replace(value, f"<value of {name}>")
    return text
