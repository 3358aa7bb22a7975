"""``LatencyProxy`` in a child process of its own, for measuring readers.

A proxy on a thread of the measuring process shares its interpreter lock with the reader
it measures: at 25 ms per request and ~100 KB per request, a reader keeping 64 requests
in flight asks the proxy for ~2,500 requests a second, and the proxy's event loop then
takes CPU time the reader would otherwise have. A real object store's latency costs the
client nothing but waiting, so ``bench consumers`` puts the proxy in another process: every
system measured (BatchWeave, raw range reads, Streaming, LitData, WebDataset) then pays
only for its own requests.

The parent drives the child over its stdin and stdout, one line each way per command:
``counters`` (answered with the counters as JSON), ``reset`` (answered ``ok``); closing
stdin stops it. The child's first line is ``{"endpoint": "http://127.0.0.1:PORT"}``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import asdict
from typing import IO, Any

from batchweave.latency import LatencyModel
from batchweave.testing.proxy import LatencyProxy, ProxyCounters

__all__ = ["ProxyProcess"]

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0


class ProxyProcess:
    """What ``LatencyProxy`` offers a benchmark (``endpoint``, ``counters()``, ``reset()``,
    ``with``), served from a child process. No ``storm``: fault tests keep the in-process
    proxy, whose storms they time from the test's own thread."""

    def __init__(self, upstream: str, model: LatencyModel | None = None, *, seed: int | None = None) -> None:
        self.upstream = upstream
        self.model = model
        self.seed = seed
        self.endpoint = ""
        self._child: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()  # one command and its answer at a time

    def start(self) -> ProxyProcess:
        model = "null" if self.model is None else json.dumps(self.model.to_dict())
        seed = "null" if self.seed is None else str(self.seed)
        command = [sys.executable, "-m", "batchweave.testing.proxyprocess", self.upstream, model, seed]
        self._child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = _read_line(self._child, "start")
        self.endpoint = json.loads(first)["endpoint"]
        return self

    def stop(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        assert child.stdin is not None
        child.stdin.close()  # the child's signal to stop
        try:
            child.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()  # our own child, by its handle
            child.wait()
        if child.stdout is not None:
            child.stdout.close()

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def counters(self) -> ProxyCounters:
        return ProxyCounters(**json.loads(self._ask("counters")))

    def reset(self) -> None:
        if self._ask("reset") != "ok":
            raise RuntimeError("the proxy process did not reset its counters")

    def _ask(self, command: str) -> str:
        with self._lock:
            child = self._child
            if child is None or child.stdin is None:
                raise RuntimeError("the proxy process is not running")
            child.stdin.write(command + "\n")
            child.stdin.flush()
            return _read_line(child, command)


def _read_line(child: subprocess.Popen[str], what: str) -> str:
    """The child's next line: its answer to ``what``, or an error if it ended instead."""
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"the proxy process ended before answering {what!r} (exit code {child.wait()})")
    return line.rstrip("\n")


def serve(upstream: str, model: dict[str, Any] | None, seed: int | None, commands: IO[str], answers: IO[str]) -> None:
    """The child's body: run the proxy, answer ``commands`` until they end."""
    with LatencyProxy(upstream, None if model is None else LatencyModel(**model), seed=seed) as proxy:
        answers.write(json.dumps({"endpoint": proxy.endpoint}) + "\n")
        answers.flush()
        for line in commands:
            command = line.strip()
            if command == "counters":
                answers.write(json.dumps(asdict(proxy.counters())) + "\n")
            elif command == "reset":
                proxy.reset()
                answers.write("ok\n")
            else:
                answers.write(json.dumps({"error": f"unknown command {command!r}"}) + "\n")
            answers.flush()


if __name__ == "__main__":
    serve(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.stdin, sys.stdout)
