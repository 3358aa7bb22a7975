"""obstore errors as obstore 0.12 words them, for tests of the error classification.

The texts copy real ones (S3 store, a server on 127.0.0.1): the Rust error's Display,
then "Debug source:" and the pretty-printed Debug of the error tree.
"""

from __future__ import annotations

from xml.sax.saxutils import escape

REASONS = {400: "Bad Request", 403: "Forbidden", 404: "Not Found", 409: "Conflict", 412: "Precondition Failed"}
REASONS.update({429: "Too Many Requests", 500: "Internal Server Error", 501: "Not Implemented"})
REASONS.update({502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"})


def obstore_status_message(key: str, status: int, *, method: str = "PUT", code: str = "AccessDenied") -> str:
    """The text of an obstore 0.12 error for an HTTP error answer (copied from real ones)."""
    uri = f"http://127.0.0.1:9000/bucket/run-1/{key}"
    # A server escapes the key in its XML body, as it must (a key may hold '<').
    body = f"<Error><Code>{code}</Code><Message>try again</Message><Key>run-1/{escape(key)}</Key></Error>"
    escaped = body.replace('"', '\\"')
    return (
        f"Generic S3 error: Error performing {method} {uri} in 1.2ms - Server returned non-2xx status code: "
        f'{status} {REASONS[status]}: {body}\n\nDebug source:\nGeneric {{\n    store: "S3",\n'
        f"    source: RetryError(\n        RetryErrorImpl {{\n            method: {method},\n"
        f"            uri: Some(\n                {uri},\n            ),\n            retries: 0,\n"
        f"            max_retries: 4,\n            elapsed: 1.2ms,\n            retry_timeout: 30s,\n"
        f"            inner: Status {{\n                status: {status},\n                body: Some(\n"
        f'                    "{escaped}",\n                ),\n            }},\n        }},\n    ),\n}}'
    )


def obstore_transport_message(key: str, kind: str) -> str:
    """The text of an obstore 0.12 error for a request that got no answer."""
    uri = f"http://127.0.0.1:9000/bucket/run-1/{key}"
    return (
        f"Generic S3 error: Error performing GET {uri} in 1s - HTTP error: error sending request\n\n"
        f'Debug source:\nGeneric {{\n    store: "S3",\n    source: RetryError(\n        RetryErrorImpl {{\n'
        f"            method: GET,\n            uri: Some(\n                {uri},\n            ),\n"
        f"            inner: Http(\n                HttpError {{\n                    kind: {kind},\n"
        f"                    source: reqwest::Error {{\n                        kind: Request,\n"
        f"                        source: TimedOut,\n                    }},\n                }},\n"
        f"            ),\n        }},\n    ),\n}}"
    )


def obstore_canceled_message(key: str, hyper_kind: str = "Canceled") -> str:
    """The text of an obstore 0.12 error for a request hyper cancelled before sending it:
    the pooled connection had been reset by the server (copied from a real one, taken
    through a server that resets every connection)."""
    uri = f"http://127.0.0.1:9000/bucket/run-1/{key}"
    return (
        f"Generic S3 error: Error performing GET {uri} in 1.179389ms - HTTP error: error sending request\n\n"
        f'Debug source:\nGeneric {{\n    store: "S3",\n    source: RetryError(\n        RetryErrorImpl {{\n'
        f"            method: GET,\n            uri: Some(\n                {uri},\n            ),\n"
        f"            retries: 0,\n            max_retries: 0,\n            elapsed: 1.179389ms,\n"
        f"            retry_timeout: 5s,\n            inner: Http(\n                HttpError {{\n"
        f"                    kind: Unknown,\n                    source: reqwest::Error {{\n"
        f"                        kind: Request,\n"
        f"                        source: hyper_util::client::legacy::Error(\n"
        f"                            {hyper_kind},\n                            hyper::Error(\n"
        f'                                {hyper_kind},\n                                "connection was not ready",\n'
        f"                            ),\n                        ),\n                    }},\n"
        f"                }},\n            ),\n        }},\n    ),\n}}"
    )
