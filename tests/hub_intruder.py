"""Another process on a training node, for the node hub's trust tests (test_node_trust):
run as another user (``nobody``) with the system's Python, or as the job's own user, so
it imports nothing of batchweave (nor anything but the standard library) and speaks the
hub's wire format by hand (``u32 header | u32 payload | JSON header | payload``, a
descriptor beside a range's reply).

    python3 hub_intruder.py probe                  print {"probe": "ok"}: this user can run it
    python3 hub_intruder.py squat PATH            try to bind the hub's socket name
    python3 hub_intruder.py read PATH IDENTITY     connect, greet, ask for log version 1
    python3 hub_intruder.py forge PATH IDENTITY SPEC   serve forged versions and ranges
    python3 hub_intruder.py flood PATH IDENTITY KEY SIZE SECONDS
        connect, greet, then ask for distinct ranges of object KEY (SIZE bytes) as fast
        as the hub reads them and never read a reply, until the hub drops the
        connection or SECONDS pass

It prints one JSON line with what happened (``forge`` runs until killed).
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import socket
import struct
import sys
import threading
import time

PREFIX = struct.Struct("<II")


def send(sock: socket.socket, header: dict, payload: bytes = b"", fds: list[int] | None = None) -> None:
    head = json.dumps(header).encode()
    first = PREFIX.pack(len(head), len(payload)) + head
    if fds:
        socket.send_fds(sock, [first], fds)
    else:
        sock.sendall(first)
    if payload:
        sock.sendall(payload)


def recv(sock: socket.socket) -> tuple[dict, bytes]:
    prefix = exactly(sock, PREFIX.size)
    head, size = PREFIX.unpack(prefix)
    header = json.loads(exactly(sock, head))
    return header, exactly(sock, size)


def exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise EOFError("closed")
        data += part
    return data


def squat(path: str) -> dict:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        return {"bind": type(exc).__name__}
    return {"bind": "ok"}


def read(path: str, identity: str) -> dict:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(path)
    except OSError as exc:
        return {"connect": type(exc).__name__}
    try:
        send(sock, {"op": "hello", "protocol": 2, "identity": identity})
        hello, _ = recv(sock)
        send(sock, {"op": "log", "id": 1, "from": 1})
        reply, payload = recv(sock)
    except (OSError, EOFError) as exc:
        return {"connect": "ok", "read": type(exc).__name__}
    return {"connect": "ok", "hello": hello, "log": reply, "bytes": len(payload)}


def forge(path: str, identity: str, spec_path: str) -> None:
    """A hub that answers with another namespace's versions and bytes (SPEC: JSON of
    ``versions``, hex by number from 1, and ``objects``, hex by key)."""
    with open(spec_path) as f:
        spec = json.load(f)
    versions = [bytes.fromhex(v) for v in spec["versions"]]
    objects = {key: bytes.fromhex(data) for key, data in spec["objects"].items()}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o777)
    listener.listen(16)
    print(json.dumps({"serving": path}), flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve_until_closed, args=(conn, identity, versions, objects), daemon=True).start()


def serve_until_closed(conn: socket.socket, identity: str, versions: list[bytes], objects: dict[str, bytes]) -> None:
    try:
        serve(conn, identity, versions, objects)
    except (OSError, EOFError):
        conn.close()


def serve(conn: socket.socket, identity: str, versions: list[bytes], objects: dict[str, bytes]) -> None:
    recv(conn)  # the rank's hello
    send(conn, {"op": "hello", "protocol": 2, "identity": identity, "id": -1})
    while True:
        request, _ = recv(conn)
        if request["op"] == "log":
            chosen = versions[request["from"] - 1 :]
            send(conn, {"id": request["id"], "sizes": [len(v) for v in chosen]}, b"".join(chosen))
        else:
            data = objects[request["key"]][request["start"] : request["start"] + request["length"]]
            fd = os.memfd_create("forged", os.MFD_ALLOW_SEALING)
            os.write(fd, data)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
            send(conn, {"id": request["id"], "length": len(data)}, fds=[fd])
            os.close(fd)


def flood(path: str, identity: str, key: str, size: str, seconds: str) -> dict:
    """Range requests, each for a range not asked before (every one a read and a
    descriptor for the hub), sent whenever the socket takes them; no reply is ever read.
    ``dropped_s``: from the first request until the hub dropped the connection (None:
    not within ``seconds``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    send(sock, {"op": "hello", "protocol": 2, "identity": identity})
    recv(sock)  # the hub's hello: the last byte this process reads
    ranges = distinct_ranges(int(size))
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    pending, requests = b"", 0
    began = time.monotonic()
    deadline = began + float(seconds)
    while time.monotonic() < deadline:
        if not pending:
            start, length = next(ranges)
            header = {"op": "range", "id": requests, "key": key, "start": start, "length": length, "sharers": 1}
            head = json.dumps(header).encode()
            pending, requests = PREFIX.pack(len(head), 0) + head, requests + 1
        events = 0
        for _, event in poller.poll(50):
            events |= event
        if events & (select.POLLHUP | select.POLLERR):
            return {"requests": requests, "dropped_s": time.monotonic() - began}
        if events & select.POLLOUT:
            try:
                pending = pending[sock.send(pending, socket.MSG_DONTWAIT) :]
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                return {"requests": requests, "dropped_s": time.monotonic() - began}
    return {"requests": requests, "dropped_s": None}


def distinct_ranges(size: int):
    """Every range of an object of ``size`` bytes, shortest first, over and over."""
    while True:
        for length in range(1, size + 1):
            for start in range(size - length + 1):
                yield start, length


def main() -> None:
    command, *args = sys.argv[1:]
    if command == "forge":
        forge(*args)
        return
    commands = {"probe": lambda: {"probe": "ok"}, "squat": squat, "read": read, "flood": flood}
    print(json.dumps(commands[command](*args)), flush=True)


if __name__ == "__main__":
    main()
