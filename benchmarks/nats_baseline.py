"""The centralized-queue baseline: NATS JetStream in the paper's strict-TGB mode.

The paper's baseline is Kafka with *strict TGB semantics*: one message carries exactly one
complete TGB and the producer count matches BatchWeave's. Kafka cannot be installed here,
so we use NATS JetStream (Debian package ``nats-server``, Python client ``nats-py``), the
other widely used centralized, durable, acknowledged queue. The mapping:

=====================================  ==============================================
Kafka (paper)                          here
=====================================  ==============================================
one topic, one message per TGB         one JetStream stream ``TGB`` (subject ``tgb``,
                                       file storage), one message per TGB
``acks`` + ``delivery.timeout.ms``     ``js.publish`` awaits the stream's ack,
                                       ``timeout`` 10 s per publish
``message.max.bytes``                  the server's ``max_payload`` (default 1 MiB)
3 replicas on a dedicated cluster      1 server, sharing this machine's cores with the
                                       producers (as BatchWeave's producers share them)
=====================================  ==============================================

A TGB larger than the server's ``max_payload`` fails (the client refuses it with
"nats: maximum payload exceeded"), and so does a publish whose ack does not come within
the timeout; both are recorded as failed TGBs, as the paper records Kafka's failures.

``max_payload`` limits: the default is 1 MiB. nats-server 2.9.x accepts any
``max_payload`` up to its ``max_pending`` (64 MiB by default) and warns above 8 MiB;
newer servers refuse anything above 64 MiB outright. We therefore clamp a requested
limit to :data:`MAX_PAYLOAD_CAP` (64 MiB) and report the limit the server announced.

JetStream file storage acks a message once it is written to the stream's files (the
server syncs to disk on its own interval, like Kafka's default flush policy).

CPU: :func:`measure_nats` records, for the measured window, the server's CPU seconds
(``server_cpu_s``: user + system time of the nats-server process it started, from
``/proc/<pid>/stat``) and the clients' (``client_cpu_s``: this process's, where every
publisher runs as a task of one event loop; it includes this process's other threads,
such as a progress display, which idle). On a machine without ``/proc`` the server's
figure is None.

The server runs on 127.0.0.1 beside the producers and keeps its files on this machine's
disk, so the like-for-like comparison with BatchWeave is ``bench producers --store
local``; ``benchmarks.producers`` says why it is not put behind the latency model.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from batchweave.errors import ConfigError
from benchmarks.report import visibility_percentiles

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "MAX_PAYLOAD_CAP",
    "find_nats_server",
    "measure_nats",
    "nats_server",
    "process_cpu_s",
    "run_nats_ingest",
]

DEFAULT_MAX_PAYLOAD = 1024 * 1024  # the server's default max_payload (1 MiB)
MAX_PAYLOAD_CAP = 64 * 1024 * 1024  # the most any supported server accepts (see module doc)
PUBLISH_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 15.0
STOP_GRACE_S = 5.0
STREAM = "TGB"
SUBJECT = "tgb"

_INSTALL_HINT = (
    "nats-server not found: install it with `apt-get install nats-server` (or run `make test`, which installs it)"
)


def find_nats_server() -> str | None:
    """Path of the ``nats-server`` binary, or None if it is not installed."""
    found = shutil.which("nats-server")
    if found:
        return found
    for candidate in ("/usr/sbin/nats-server", "/usr/bin/nats-server"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers_info(port: int) -> bool:
    """True once the server accepts a connection and greets it with its INFO line."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.settimeout(0.5)
            return s.recv(4).startswith(b"INFO")
    except OSError:
        return False


@contextlib.contextmanager
def nats_server(workdir: Path, max_payload_bytes: int | None = None) -> Iterator[str]:
    """Run ``nats-server`` with JetStream (file storage under ``workdir/js``) on a free
    127.0.0.1 port; yield its ``nats://127.0.0.1:PORT`` URL; stop it on exit.

    ``max_payload_bytes`` (clamped to :data:`MAX_PAYLOAD_CAP`) raises or lowers the
    server's per-message limit through a config file; None keeps the 1 MiB default.
    The server's log goes to ``workdir/nats-server.log``.
    """
    with _served(workdir, max_payload_bytes) as (url, _pid):
        yield url


@contextlib.contextmanager
def _served(workdir: Path, max_payload_bytes: int | None) -> Iterator[tuple[str, int]]:
    """:func:`nats_server`, yielding the server process's id beside its URL."""
    binary = find_nats_server()
    if binary is None:
        raise ConfigError(_INSTALL_HINT)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    args = [binary, "-a", "127.0.0.1", "-js", "-sd", str(workdir / "js")]
    if max_payload_bytes is not None:
        if max_payload_bytes <= 0:
            raise ConfigError(f"max_payload_bytes must be positive, got {max_payload_bytes}")
        conf = workdir / "nats-server.conf"
        conf.write_text(f"max_payload: {min(int(max_payload_bytes), MAX_PAYLOAD_CAP)}\n")
        args += ["-c", str(conf)]
    log_path = workdir / "nats-server.log"

    tail = ""  # the server log's end, once a start failed
    for _attempt in range(3):  # a free port can be taken between probing and binding
        port = _free_port()
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [*args, "-p", str(port)], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline and not _answers_info(port):
            time.sleep(0.02)
        if proc.poll() is None and _answers_info(port):
            break
        _stop(proc)
        tail = log_path.read_text(errors="replace")[-2000:]
        if "address already in use" not in tail:
            raise ConfigError(f"nats-server did not start (exit {proc.returncode}); log:\n{tail}")
    else:
        raise ConfigError(f"nats-server could not bind a free port; log:\n{tail}")

    try:
        yield f"nats://127.0.0.1:{port}", proc.pid
    finally:
        _stop(proc)


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far, from
    ``/proc/<pid>/stat``; None where there is no such file (not Linux, or it exited).

    The counts are in clock ticks (usually 10 ms), which a window of seconds absorbs.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    # utime and stime are fields 14 and 15, the 12th and 13th after the name.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _make_tgb(payload_bytes: int, tgb_slices: int, seed: int) -> bytes:
    """One TGB of exactly ``payload_bytes``: ``tgb_slices`` slices of
    ``payload_bytes // tgb_slices`` bytes, the last one taking the remainder."""
    base = payload_bytes // tgb_slices
    sizes = [base] * (tgb_slices - 1) + [payload_bytes - base * (tgb_slices - 1)]
    chunk = (seed.to_bytes(4, "little") + os.urandom(60)) * (max(sizes) // 64 + 1)
    return b"".join(chunk[:n] for n in sizes)


async def _quiet(*_args: Any) -> None:
    return None


ServerCpu = Callable[[], float | None]  # the server's CPU seconds so far (None: unknown)


def _cpu_now(server_cpu_s: ServerCpu | None) -> tuple[float, float | None]:
    """(this process's CPU seconds, the server's) at this moment."""
    return time.process_time(), server_cpu_s() if server_cpu_s else None


def _cpu_between(started: tuple[float, float | None], ended: tuple[float, float | None]) -> dict[str, float | None]:
    """The clients' and the server's CPU seconds between two :func:`_cpu_now` samples."""
    server = None if started[1] is None or ended[1] is None else ended[1] - started[1]
    return {"client_cpu_s": ended[0] - started[0], "server_cpu_s": server}


async def run_nats_ingest(
    url: str,
    producers: int,
    payload_bytes: int,
    duration_s: float,
    tgb_slices: int = 32,
    server_cpu_s: ServerCpu | None = None,
) -> dict[str, Any]:
    """Strict-TGB ingest into JetStream: ``producers`` concurrent publishers, each on its
    own connection, each publishing one whole TGB per message and awaiting the ack before
    the next (sequential per producer), for ``duration_s`` seconds after a warm-up (at
    least min(1 s, 20% of ``duration_s``) and until every producer finished one publish).

    ``payload_bytes`` is the size of ONE TGB (all ``tgb_slices`` slices concatenated),
    i.e. of one message. Outcomes are counted by when they happen: a TGB is committed if
    its ack arrives inside the measured window, failed if its publish raised inside the
    window (over the server's max payload, no ack within 10 s, ...); a publish still in
    flight when the window ends is not counted. (Counting by completion keeps the rate
    unbiased when one publish takes a sizeable part of the window, e.g. 32 producers of
    10 MB TGBs.) ``throughput_mb_s`` is committed bytes / ``duration_s`` / 1e6.
    If every publish failed, throughput is 0 and ``error`` says why: the caller treats
    that as a failed point. A TGB over the limit is refused by the client at once, so
    such a run records many failed attempts.

    ``client_cpu_s`` is this process's CPU seconds in the window (the publishers' work),
    ``server_cpu_s`` the window's difference of ``server_cpu_s()`` (None without it).
    """
    import nats
    from nats.errors import MaxPayloadError
    from nats.js.api import StorageType, StreamConfig

    if producers < 1 or payload_bytes < 1 or tgb_slices < 1 or duration_s <= 0:
        raise ConfigError(
            f"need producers>=1, payload_bytes>=1, tgb_slices>=1, duration_s>0; got "
            f"{producers}, {payload_bytes}, {tgb_slices}, {duration_s}"
        )
    tgb_slices = min(tgb_slices, payload_bytes)
    warmup_s = min(1.0, 0.2 * duration_s)

    conns = []
    try:
        for _ in range(producers):
            conns.append(
                await nats.connect(
                    url, connect_timeout=5, allow_reconnect=False, error_cb=_quiet, disconnected_cb=_quiet
                )
            )
        max_payload = conns[0].max_payload
        js0 = conns[0].jetstream(timeout=PUBLISH_TIMEOUT_S)
        # max_msg_size left at -1 (unlimited): the server's max_payload is the only limit.
        config = StreamConfig(name=STREAM, subjects=[SUBJECT], storage=StorageType.FILE)
        deadline = time.monotonic() + 10.0
        while True:  # JetStream can need a moment after the port opens
            try:
                await js0.add_stream(config)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

        inf = float("inf")
        window = [inf, inf]  # [t0, t_end], set once the warm-up is over
        primed = [False] * producers
        all_primed = asyncio.Event()
        committed = failed = 0
        first_error: str | None = None
        acked_s: list[float] = []  # publish -> ack of each TGB in the window: its visibility latency

        def done(index: int) -> None:
            if not primed[index]:
                primed[index] = True
                if all(primed):
                    all_primed.set()

        async def producer(index: int, nc: Any) -> None:
            nonlocal committed, failed, first_error
            js = nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
            tgb = _make_tgb(payload_bytes, tgb_slices, index)
            while time.monotonic() < window[1]:
                started = time.monotonic()
                try:
                    await js.publish(SUBJECT, tgb, timeout=PUBLISH_TIMEOUT_S, stream=STREAM)
                except Exception as exc:  # every failure of one TGB is a failed TGB
                    done(index)
                    if window[0] <= time.monotonic() <= window[1]:
                        failed += 1
                        if first_error is None:
                            first_error = f"{type(exc).__name__}: {exc}"
                            if isinstance(exc, MaxPayloadError):
                                first_error += f" (TGB of {payload_bytes} B > server max_payload {max_payload} B)"
                    # A client-side refusal never yields by itself; a closed connection
                    # fails at once too: do not spin the event loop.
                    await asyncio.sleep(0.01 if nc.is_closed else 0)
                    continue
                done(index)
                if window[0] <= time.monotonic() <= window[1]:
                    committed += 1
                    acked_s.append(time.monotonic() - started)

        tasks = [asyncio.create_task(producer(i, nc)) for i, nc in enumerate(conns)]
        # Warm-up: at least warmup_s, and until every producer has finished one publish
        # (with 32 producers of 10 MB TGBs the first round alone takes seconds).
        await asyncio.sleep(warmup_s)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(all_primed.wait(), timeout=PUBLISH_TIMEOUT_S + 5.0)
        window[0] = time.monotonic()
        window[1] = window[0] + duration_s
        cpu_started = _cpu_now(server_cpu_s)
        # CPU is sampled at the window's close, as the outcomes are counted: the publishes
        # still in flight then are not the window's work.
        await asyncio.sleep(duration_s)
        cpu = _cpu_between(cpu_started, _cpu_now(server_cpu_s))
        await asyncio.gather(*tasks)
    finally:
        for nc in conns:
            with contextlib.suppress(Exception):
                await nc.close()

    attempted = committed + failed
    return {
        "system": "nats",
        "policy": "strict-tgb",
        "producers": producers,
        "payload_bytes": payload_bytes,
        "tgb_slices": tgb_slices,
        "duration_s": duration_s,
        "tgbs_committed": committed,
        "tgbs_failed": failed,
        "throughput_mb_s": committed * payload_bytes / duration_s / 1e6,
        "commit_success_rate": committed / attempted if attempted else 0.0,
        "max_payload_bytes": max_payload,
        **visibility_percentiles(acked_s),
        **cpu,
        "error": first_error,
    }


def measure_nats(
    producers: int,
    payload_bytes: int,
    duration_s: float,
    workdir: Path,
    max_payload_bytes: int | None = None,
    tgb_slices: int = 32,
) -> dict[str, Any]:
    """Start a fresh server in ``workdir``, run :func:`run_nats_ingest` (the server's CPU
    read from its process), stop the server and delete its JetStream data. Returns the
    ingest record."""
    workdir = Path(workdir)
    try:
        with _served(workdir, max_payload_bytes) as (url, pid):
            ingest = run_nats_ingest(
                url, producers, payload_bytes, duration_s, tgb_slices, server_cpu_s=lambda: process_cpu_s(pid)
            )
            return asyncio.run(ingest)
    finally:
        shutil.rmtree(workdir / "js", ignore_errors=True)
