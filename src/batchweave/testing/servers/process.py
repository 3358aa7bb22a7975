"""One server process: start it on 127.0.0.1, wait until it answers, stop it (and remove
what a SIGKILLed server leaves behind). What every server of ``batchweave.testing.servers``
is started and stopped with.

Ports are ones that were free a moment before; a server that dies during startup (its
port taken meanwhile) is tried again on fresh ports. On Linux the server also dies with
the process that started it, even by SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from batchweave.errors import ConfigError

__all__ = [
    "STARTUP_TIMEOUT_S",
    "Service",
    "environment",
    "http_answers",
    "node_binary",
    "on_port",
    "served",
    "start_with_port_retry",
]


#: Seconds a server gets to answer (SeaweedFS takes ~4 s on an idle 2-core machine,
#: a cold Azurite 1-2 s).
STARTUP_TIMEOUT_S = 60.0


@dataclass
class Service:
    """One server subprocess and its log file, as the ``start_*`` functions return it:
    ``endpoint`` is its ``http://127.0.0.1:PORT``; ``stop()`` stops it."""

    name: str
    cmd: list[str]
    endpoint: str
    log_path: Path  # the server's working directory is this file's directory
    env: dict[str, str] | None = None  # the child's whole environment (None: inherit ours)
    term_timeout_s: float = 10.0  # how long to wait after SIGTERM before SIGKILL (0: SIGKILL at once)
    death_signal: int = signal.SIGTERM  # sent to the server if the starting process dies
    leftovers: list[Path] = field(default_factory=list)  # files a SIGKILLed server leaves behind
    proc: subprocess.Popen | None = None
    startup_seconds: float = 0.0
    crashed: bool = False  # exited during startup (vs. never answered)
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    def start(self, ready: Callable[[str], bool], timeout_s: float = STARTUP_TIMEOUT_S) -> Service:
        """Start the process and poll ``ready(endpoint)`` until it returns True."""
        self._log_file = open(self.log_path, "ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=self.log_path.parent,
            env=self.env,
            preexec_fn=functools.partial(_die_with_parent, self.death_signal)
            if sys.platform.startswith("linux")
            else None,
        )
        delay = 0.02
        while True:
            if self.proc.poll() is not None:
                self.crashed = True
                self.stop()
                raise ConfigError(
                    f"{self.name} exited with code {self.proc.returncode} during startup.\n"
                    f"command: {' '.join(self.cmd)}\n{self._log_tail()}"
                )
            with contextlib.suppress(Exception):
                if ready(self.endpoint):
                    self.startup_seconds = time.monotonic() - t0
                    return self
            if time.monotonic() - t0 > timeout_s:
                self.stop()
                raise ConfigError(
                    f"{self.name} did not answer on {self.endpoint} within {timeout_s:.0f} s.\n"
                    f"command: {' '.join(self.cmd)}\n{self._log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after ``term_timeout_s``), reap it and
        remove the files it leaves behind; safe to call twice."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate() if self.term_timeout_s > 0 else proc.kill()
            try:
                proc.wait(timeout=self.term_timeout_s or 10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=10)
        for path in self.leftovers:
            with contextlib.suppress(OSError):
                path.unlink()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _log_tail(self, limit: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            text = ""
        return f"--- {self.name} log ({self.log_path}) ---\n{text[-limit:]}"


def _die_with_parent(death_signal: int = signal.SIGKILL) -> None:  # pragma: no cover - runs in the child
    """``preexec_fn``: a new session (a Ctrl-C reaches only the parent, which stops the
    server itself), and ask Linux to signal the child when the parent dies, even by SIGKILL."""
    os.setsid()
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, death_signal)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _require_free(port: int) -> None:
    """ConfigError unless ``port`` is a TCP port free on 127.0.0.1 now: a server already
    there would answer the readiness check for the one that could not bind it."""
    if not 0 < port < 65536:
        raise ConfigError(f"port {port} is not a TCP port (1 to 65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise ConfigError(f"port {port} on 127.0.0.1 is taken ({exc.strerror}): choose another, or none") from None


def start_with_port_retry(
    make: Callable[[int], Service],
    ready: Callable[[str], bool],
    timeout_s: float,
    attempts: int = 3,
    *,
    port: int | None = None,
) -> Service:
    """Start a service; again on a fresh port if it dies during startup (the port taken
    meanwhile). ``port``: that port, once (None: a free one)."""
    if port is not None:
        _require_free(port)
    last: ConfigError | None = None
    for _ in range(1 if port is not None else attempts):
        svc = make(_free_port() if port is None else port)
        try:
            return svc.start(ready, timeout_s)
        except ConfigError as exc:
            last = exc
            if not svc.crashed:
                break  # timed out rather than crashed: retrying will not help
    if port is not None and last is not None:
        raise ConfigError(f"{last} (port {port} was asked for: is it free?)") from None
    assert last is not None
    raise last


def on_port(name: str, log_stem: Path, command: Callable[[int], list[str]]) -> Callable[[int], Service]:
    """``make`` for ``start_with_port_retry``: the server ``command(port)`` at
    ``http://127.0.0.1:PORT``, its log in ``LOG_STEM-PORT.log``."""

    def make(port: int) -> Service:
        endpoint = f"http://127.0.0.1:{port}"
        return Service(name=name, cmd=command(port), endpoint=endpoint, log_path=Path(f"{log_stem}-{port}.log"))

    return make


def http_answers(url: str) -> bool:
    """True once the server returns any HTTP response (an error status counts)."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True


def node_binary(name: str, package: str, binary: str | os.PathLike[str] | None) -> Path:
    """``binary``, or else ``node_modules/.bin/NAME`` in the current directory or a parent
    (where ``npm install`` puts it), or else ``NAME`` on PATH."""
    if binary is not None:
        where = Path(binary)
    else:
        here = Path.cwd()
        local = (d / "node_modules" / ".bin" / name for d in (here, *here.parents))
        where = next((p for p in local if p.exists()), None) or Path(shutil.which(name) or f"node_modules/.bin/{name}")
    if not where.exists():
        raise ConfigError(
            f"{name} is not installed ({where} is missing): npm install {package} "
            "(in a checkout of BatchWeave: npm ci, which `make test` runs)"
        )
    return where


@contextmanager
def served(prefix: str, start: Callable[[Path], Service]) -> Iterator[Service]:
    """A temporary directory and a service started in it; both gone on exit."""
    workdir = Path(tempfile.mkdtemp(prefix=f"batchweave-{prefix}-"))
    try:
        service = start(workdir)
        try:
            yield service
        finally:
            service.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def environment(values: dict[str, str], unset: tuple[str, ...]) -> Iterator[None]:
    """Set ``values`` and remove ``unset`` in ``os.environ``; put everything back on exit."""
    saved = {key: os.environ.get(key) for key in (*values, *unset)}
    for key in unset:
        os.environ.pop(key, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
