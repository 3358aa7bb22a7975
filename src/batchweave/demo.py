"""``batchweave demo``: real producer and consumer processes on a local namespace.

What runs, all as separate OS processes started with the ``spawn`` context:

* ``producers`` preprocessing workers (``prep-0``, ``prep-1``, ...). Each one owns a fixed
  share of the steps and, per source offset, makes a Transactional Global Batch of
  ``dp * cp`` slices: it generates synthetic "raw images" of random sizes (deterministic
  per ``(producer, offset, slice)``), compresses them (the stand-in for PNG/JPEG files on
  disk), decodes them again, resizes them to 32x32 (bilinear, in numpy), normalizes them,
  derives a variable-length token sequence from each image and packs the sequences into
  fixed ``[rows, seq_len]`` int32 rows with segment ids and an attention mask.
* ``dp * cp`` consumer processes, one per training rank (rank passed explicitly), each
  reading its own slice of every step until the end of the stream and recording the
  step, the TGB's provenance and a checksum of its slice to a JSON file.

Midway the demo SIGKILLs one producer (for real: ``os.kill(pid, SIGKILL)``, with TGBs
uploaded but not yet committed) and starts it again under the same ``producer_id``; the
new incarnation claims a higher epoch and resumes at ``resume_offset``. When all
producers are done the demo commits the end-of-stream marker, waits for the ranks and
checks the invariants from what the ranks actually received: the same dense step order
0..N-1 on every rank, the same TGB provenance on every rank of a step, each rank reading
its own slice, every producer's offsets exactly 0..k-1 across the kill, and sampled
slices that regenerate bit-identically from their source offset.

``run_demo()`` is the importable entry point; ``batchweave demo`` is a thin wrapper.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import struct
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from batchweave.consumer import Consumer
from batchweave.errors import BatchWeaveError, ConfigError
from batchweave.inspect import NamespaceInfo, inspect_namespace
from batchweave.producer import Producer, end_stream

__all__ = [
    "DEFAULT_STEPS",
    "build_slice",
    "build_tgb",
    "prepare_demo_dir",
    "render_summary",
    "run_demo",
    "slice_checksum",
]

DEFAULT_STEPS = 200
IMAGES_PER_SLICE = 8  # per-rank micro-batch of images
RESOLUTION = 32  # images are resized to RESOLUTION x RESOLUTION
SEQ_LEN = 256  # packed token rows are [IMAGES_PER_SLICE // 2, SEQ_LEN]
PAD, BOS, EOS = 0, 257, 258  # token ids; pixel tokens are 1..256
_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)  # the usual ImageNet statistics
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

MARKER = ".batchweave-demo"  # marks a directory the demo created and may wipe
_OWNED_CHILDREN = ("namespace", "results", "summary.json")
_KEEP_DEFAULT_RUNS = 3
_CONSUMER_TIMEOUT_S = 120.0
_POLL_S = 0.5


def producer_id(index: int) -> str:
    return f"prep-{index}"


# -- preprocessing: the work a real data pipeline does ------------------------------


def _synth_raw_image(rng: np.random.Generator) -> np.ndarray:
    """A random-size uint8 [h, w, 3] "photo": a colour gradient, a few boxes, sensor noise."""
    h, w = (int(v) for v in rng.integers(24, 129, size=2))
    c0, c1 = rng.uniform(0, 255, size=(2, 3)).astype(np.float32)
    a = np.float32(rng.uniform())
    t = a * np.linspace(0, 1, h, dtype=np.float32)[:, None] + (1 - a) * np.linspace(0, 1, w, dtype=np.float32)[None, :]
    img = c0 * (1 - t[..., None]) + c1 * t[..., None]
    for _ in range(int(rng.integers(1, 4))):
        y0, x0 = int(rng.integers(0, h - 4)), int(rng.integers(0, w - 4))
        y1, x1 = int(rng.integers(y0 + 2, h)), int(rng.integers(x0 + 2, w))
        img[y0:y1, x0:x1] = rng.uniform(0, 255, size=3).astype(np.float32)
    img += rng.normal(0, 6, size=img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def _encode_image(img: np.ndarray) -> bytes:
    """The compressed file a dataset would store (zlib of the pixels, as PNG does)."""
    h, w, _ = img.shape
    return struct.pack("<HH", h, w) + zlib.compress(img.tobytes(), 6)


def _decode_image(blob: bytes) -> np.ndarray:
    h, w = struct.unpack_from("<HH", blob)
    return np.frombuffer(zlib.decompress(blob[4:]), dtype=np.uint8).reshape(h, w, 3)


def _resize_bilinear(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """Bilinear resampling with pixel-centre alignment; float32 [out_h, out_w, C]."""
    h, w = img.shape[:2]
    ys = np.clip((np.arange(out_h, dtype=np.float32) + 0.5) * (h / out_h) - 0.5, 0, h - 1)
    xs = np.clip((np.arange(out_w, dtype=np.float32) + 0.5) * (w / out_w) - 0.5, 0, w - 1)
    y0, x0 = ys.astype(np.intp), xs.astype(np.intp)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    wy, wx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
    f = img.astype(np.float32).reshape(h, w, -1)
    top = f[y0][:, x0] * (1 - wx) + f[y0][:, x1] * wx
    bottom = f[y1][:, x0] * (1 - wx) + f[y1][:, x1] * wx
    return top * (1 - wy) + bottom * wy


def _tokenize(img: np.ndarray) -> np.ndarray:
    """A variable-length token sequence from image content: an 8x8-cell grey-level grid."""
    h, w = img.shape[:2]
    grid = _resize_bilinear(img.mean(axis=2, keepdims=True), max(1, h // 8), max(1, w // 8))
    body = np.clip(grid.reshape(-1), 0, 255).astype(np.int32) + 1
    return np.concatenate([[BOS], body, [EOS]]).astype(np.int32)


def _pack(sequences: Sequence[np.ndarray], rows: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """First-fit sequence packing into [rows, seq_len]; returns (tokens, segment ids).

    Segment ids number the sequences inside a row from 1 (0 is padding), so attention can
    be block-diagonal; a sequence longer than a row is truncated, one that fits nowhere is
    dropped, as packing loaders do.
    """
    tokens = np.full((rows, seq_len), PAD, dtype=np.int32)
    segments = np.zeros((rows, seq_len), dtype=np.int32)
    fill = np.zeros(rows, dtype=np.intp)
    count = np.zeros(rows, dtype=np.int32)
    for seq in sequences:
        seq = seq[:seq_len]
        fits = np.flatnonzero(seq_len - fill >= len(seq))
        if len(fits) == 0:
            continue
        r = fits[0]
        count[r] += 1
        tokens[r, fill[r] : fill[r] + len(seq)] = seq
        segments[r, fill[r] : fill[r] + len(seq)] = count[r]
        fill[r] += len(seq)
    return tokens, segments


def build_slice(
    producer_index: int, offset: int, slice_index: int, images: int = IMAGES_PER_SLICE
) -> dict[str, np.ndarray]:
    """One rank's slice of the TGB at ``offset``; a pure function of its arguments."""
    rng = np.random.default_rng([producer_index, offset, slice_index])
    blobs = [_encode_image(_synth_raw_image(rng)) for _ in range(images)]  # the "files"
    pixels = np.empty((images, 3, RESOLUTION, RESOLUTION), dtype=np.float16)
    sequences = []
    for i, blob in enumerate(blobs):
        img = _decode_image(blob)
        small = _resize_bilinear(img, RESOLUTION, RESOLUTION)
        pixels[i] = ((small / 255.0 - _MEAN) / _STD).transpose(2, 0, 1)
        sequences.append(_tokenize(img))
    tokens, segments = _pack(sequences, max(1, images // 2), SEQ_LEN)
    return {
        "pixels": pixels,
        "tokens": tokens,
        "segments": segments,
        "mask": segments > 0,
        "source": np.array([producer_index, offset, slice_index], dtype=np.int64),
    }


def build_tgb(
    producer_index: int, offset: int, slices: int, images: int = IMAGES_PER_SLICE
) -> list[dict[str, np.ndarray]]:
    return [build_slice(producer_index, offset, s, images) for s in range(slices)]


def slice_checksum(data: dict[str, np.ndarray]) -> str:
    """CRC32 over names, dtypes, shapes and bytes of a slice's arrays (order-independent)."""
    crc = 0
    for name in sorted(data):
        array = np.ascontiguousarray(data[name])
        crc = zlib.crc32(f"{name}|{array.dtype.str}|{array.shape}".encode(), crc)
        crc = zlib.crc32(array.tobytes(), crc)
    return f"{crc:08x}"


# -- worker processes (top-level functions: the spawn context imports them) ----------


def _write_json(path: Path, value: Any) -> None:
    """Atomic replace, so a reader (or a SIGKILL) never leaves a half-written file."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def _producer_main(
    url: str, index: int, share: int, dp: int, cp: int, images: int, results: str, incarnation: int, appended: Any
) -> None:
    pid = producer_id(index)
    out = Path(results) / f"producer-{pid}-{incarnation}.json"
    record: dict[str, Any] = {"producer_id": pid, "incarnation": incarnation, "os_pid": os.getpid(), "done": False}
    try:
        with Producer(url, pid, dp=dp, cp=cp) as producer:
            start = producer.resume_offset
            record.update(resume_offset=start, epoch=producer.epoch, metrics=producer.metrics())
            appended[index] = start
            _write_json(out, record)
            for offset in range(start, share):
                producer.append(build_tgb(index, offset, dp * cp, images), source_offset=offset)
                appended[index] = offset + 1
                if (offset - start) % 4 == 3:  # a SIGKILL loses at most the last few counts
                    record["metrics"] = producer.metrics()
                    _write_json(out, record)
        record.update(metrics=producer.metrics(), done=True)  # close() flushed everything
        _write_json(out, record)
    except BatchWeaveError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        _write_json(out, record)
        sys.exit(1)


def _consumer_main(url: str, dp: int, cp: int, rank: int, results: str, progress: Any) -> None:
    for name in ("RANK", "WORLD_SIZE"):  # the demo passes ranks explicitly
        os.environ.pop(name, None)
    out = Path(results) / f"rank-{rank}.json"
    record: dict[str, Any] = {"rank": rank, "steps": [], "sources": [], "checksums": [], "bytes": 0, "error": None}
    try:
        with Consumer(url, dp=dp, cp=cp, rank=rank, timeout_s=_CONSUMER_TIMEOUT_S) as consumer:
            record["slice_index"] = consumer.slice_index
            for batch in consumer:
                assert isinstance(batch.data, dict)
                record["steps"].append(batch.step)
                record["sources"].append(batch.data["source"].tolist())
                record["checksums"].append(slice_checksum(batch.data))
                record["bytes"] += sum(a.nbytes for a in batch.data.values())
                progress[rank] = len(record["steps"])
    except BatchWeaveError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    _write_json(out, record)
    if record["error"]:
        sys.exit(1)


# -- the directory the demo owns ------------------------------------------------------


def prepare_demo_dir(directory: str | os.PathLike[str]) -> Path:
    """Make ``directory`` a fresh demo directory; never touch one the demo did not create.

    A missing or empty directory is taken and marked; one that carries the demo's marker
    has its previous namespace and results removed (nothing else in it); anything else is
    refused with a ConfigError.
    """
    path = Path(directory).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"demo directory {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        if not (path / MARKER).is_file():
            raise ConfigError(
                f"demo directory {path} is not empty and was not created by the demo; "
                "give an empty or new directory (--dir)"
            )
        for name in _OWNED_CHILDREN:
            child = path / name
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            elif child.exists() or child.is_symlink():
                child.unlink()
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text(json.dumps({"created_by": "batchweave demo", "at": time.time()}) + "\n")
    return path


def default_demo_dir(root: str | os.PathLike[str] = "demo-data") -> Path:
    """``root/<timestamp>``, fresh for every run; prunes older demo runs, keeping a few.

    Only subdirectories of ``root`` that carry the demo's marker are ever pruned.
    """
    base = Path(root)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = base / stamp, 1
    while path.exists():
        n += 1
        path = base / f"{stamp}-{n}"
    if base.is_dir():
        ours = sorted(
            (p for p in base.iterdir() if p.is_dir() and not p.is_symlink() and (p / MARKER).is_file()),
            key=lambda p: p.stat().st_mtime,
        )
        for old in ours[: max(0, len(ours) - (_KEEP_DEFAULT_RUNS - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    return path


# -- the orchestrator -----------------------------------------------------------------


def _shares(steps: int, producers: int) -> list[int]:
    return [steps // producers + (1 if i < steps % producers else 0) for i in range(producers)]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class _Run:
    """State of one demo run, shared by the control loop and the live display."""

    def __init__(self, url: str, producers: int, steps: int, dp: int, cp: int) -> None:
        self.url = url
        self.steps = steps
        self.dp, self.cp = dp, cp
        self.shares = _shares(steps, producers)
        self.started = time.monotonic()
        self.info: NamespaceInfo | None = None
        self.states = ["starting"] * producers
        self.events: list[str] = []

    def event(self, text: str) -> None:
        self.events.append(f"[dim]{time.monotonic() - self.started:6.1f}s[/] {text}")


def _render_live(run: _Run, appended: Any, progress: Any) -> Any:
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    info = run.info
    committed = info.steps if info else 0
    head = Table.grid(padding=(0, 2))
    head.add_row(
        "[bold]committed steps[/]",
        ProgressBar(total=run.steps, completed=committed, width=40),
        f"{committed}/{run.steps}",
        f"log v{info.latest_version if info else 0}",
        f"{(info.bytes if info else 0) / 1e6:.1f} MB",
        "[green]end of stream[/]" if info and info.end_of_stream else "",
    )
    prods = Table(title="producers", title_justify="left", expand=False)
    for col in ("id", "state", "epoch", "appended", "committed", ""):
        prods.add_column(col)
    for i, share in enumerate(run.shares):
        pid = producer_id(i)
        p = info.producers.get(pid, {}) if info else {}
        done = p.get("offset", 0)
        prods.add_row(
            pid,
            run.states[i],
            str(p.get("epoch", "-")),
            f"{appended[i]}/{share}",
            f"{done}/{share}",
            ProgressBar(total=share, completed=done, width=24),
        )
    ranks = Table(title="consumer ranks", title_justify="left", expand=False)
    for col in ("rank", "(d, c)", "steps read", ""):
        ranks.add_column(col)
    for r in range(run.dp * run.cp):
        ranks.add_row(
            str(r),
            f"({r // run.cp}, {r % run.cp})",
            f"{progress[r]}/{run.steps}",
            ProgressBar(total=run.steps, completed=progress[r], width=24),
        )
    return Group(head, prods, ranks, *run.events[-6:])


def run_demo(
    directory: str | os.PathLike[str],
    producers: int = 3,
    steps: int = DEFAULT_STEPS,
    dp: int = 2,
    cp: int = 2,
    kill: bool = True,
    console: Any = None,
    images_per_slice: int = IMAGES_PER_SLICE,
) -> dict[str, Any]:
    """Run the demo in ``directory`` (a fresh namespace under it) and return the summary.

    ``summary["ok"]`` tells whether every check passed; ``summary["checks"]`` has each
    check with its detail. The summary is also written to ``directory/summary.json``.
    """
    from rich.console import Console
    from rich.live import Live

    for name, value, low in (
        ("producers", producers, 1),
        ("steps", steps, 1),
        ("dp", dp, 1),
        ("cp", cp, 1),
        ("images_per_slice", images_per_slice, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"demo: {name} must be an integer >= {low}, got {value!r}")
    if steps < producers:
        raise ConfigError(f"demo: steps ({steps}) must be at least the number of producers ({producers})")
    if producers > 64 or dp * cp > 64:
        raise ConfigError(f"demo: at most 64 producers and 64 ranks (dp*cp) on one machine, got {producers}, {dp * cp}")
    console = console or Console()
    root = prepare_demo_dir(directory)
    ns_dir, results = root / "namespace", root / "results"
    ns_dir.mkdir()
    results.mkdir()
    url = str(ns_dir)
    world = dp * cp
    ctx = mp.get_context("spawn")
    appended = ctx.RawArray("q", producers)  # lock-free: a SIGKILLed writer cannot wedge a lock
    progress = ctx.RawArray("q", world)
    run = _Run(url, producers, steps, dp, cp)
    victim = producers // 2
    do_kill = kill and run.shares[victim] >= 2
    kill_at = max(1, run.shares[victim] // 2)
    killed: dict[str, Any] | None = None
    prod_procs: list[Any] = [None] * producers
    incarnations = [0] * producers
    cons_procs: list[Any] = []
    failures: list[str] = []

    def start_producer(i: int) -> None:
        proc = ctx.Process(
            target=_producer_main,
            args=(url, i, run.shares[i], dp, cp, images_per_slice, str(results), incarnations[i], appended),
            name=f"batchweave-demo-{producer_id(i)}",
            daemon=True,
        )
        proc.start()
        prod_procs[i] = proc

    console.print(
        f"[bold]BatchWeave demo[/]: {producers} producer processes, {world} consumer ranks (dp={dp}, cp={cp}), "
        f"{steps} steps\nnamespace {url}"
    )
    if kill and not do_kill:
        console.print("[yellow]kill skipped: the victim's share is too small[/]")
    try:
        with Live(_render_live(run, appended, progress), console=console, refresh_per_second=4) as live:
            run.started = time.monotonic()
            for r in range(world):
                proc = ctx.Process(
                    target=_consumer_main,
                    args=(url, dp, cp, r, str(results), progress),
                    name=f"batchweave-demo-rank{r}",
                    daemon=True,
                )
                proc.start()
                cons_procs.append(proc)
            for i in range(producers):
                start_producer(i)
                run.states[i] = "running"
            next_poll = 0.0
            while True:
                now = time.monotonic()
                if do_kill and killed is None and appended[victim] >= kill_at and prod_procs[victim].is_alive():
                    proc = prod_procs[victim]
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.join()
                    info = inspect_namespace(url)  # nothing of the victim can commit any more
                    killed = {
                        "producer_id": producer_id(victim),
                        "os_pid": proc.pid,
                        "at_s": round(now - run.started, 2),
                        "appended_before_kill": int(appended[victim]),
                        "committed_at_kill": info.producers[producer_id(victim)]["offset"],
                        "epoch_before": info.producers[producer_id(victim)]["epoch"],
                    }
                    run.event(
                        f"[red]SIGKILL[/] {killed['producer_id']} (pid {proc.pid}): appended offsets "
                        f"0..{killed['appended_before_kill'] - 1}, committed 0..{killed['committed_at_kill'] - 1}"
                    )
                    incarnations[victim] += 1
                    start_producer(victim)
                    run.states[victim] = "[yellow]restarted[/]"
                    run.event(
                        f"restarted {killed['producer_id']} with the same producer_id (pid {prod_procs[victim].pid})"
                    )
                for i, proc in enumerate(prod_procs):
                    if proc.exitcode is not None and run.states[i] not in ("done", "[red]failed[/]"):
                        if proc.exitcode == 0:
                            run.states[i] = "done"
                            run.event(f"{producer_id(i)} finished its {run.shares[i]} TGBs")
                        else:
                            run.states[i] = "[red]failed[/]"
                            failures.append(f"{producer_id(i)} exited with code {proc.exitcode}")
                            run.event(f"[red]{producer_id(i)} failed (exit code {proc.exitcode})[/]")
                if now >= next_poll:
                    run.info = inspect_namespace(url)
                    next_poll = now + _POLL_S
                    live.update(_render_live(run, appended, progress))
                if all(p.exitcode is not None for p in prod_procs):
                    break
                time.sleep(0.02)
            if do_kill and killed is None:
                run.event(f"[yellow]no kill: {producer_id(victim)} finished before reaching offset {kill_at}[/]")
            version = end_stream(url)
            run.event(f"all producers done: end of stream committed at log version {version}")
            deadline = time.monotonic() + _CONSUMER_TIMEOUT_S
            while any(p.is_alive() for p in cons_procs) and time.monotonic() < deadline:
                run.info = inspect_namespace(url)
                live.update(_render_live(run, appended, progress))
                for p in cons_procs:
                    p.join(timeout=_POLL_S / len(cons_procs))
            wall = time.monotonic() - run.started
            run.info = inspect_namespace(url)
            live.update(_render_live(run, appended, progress))
    finally:
        for proc in [*prod_procs, *cons_procs]:
            if proc is not None and proc.is_alive():
                proc.kill()  # only processes this demo started, by their handle
                proc.join()
    console.print()
    for r, proc in enumerate(cons_procs):
        if proc.exitcode != 0:
            failures.append(f"rank {r} exited with code {proc.exitcode}")

    summary = _summarize(run, results, killed, failures, wall, images_per_slice)
    summary["directory"] = str(root)
    _write_json(root / "summary.json", summary)
    console.print(render_summary(summary))
    return summary


# -- checks and summary ---------------------------------------------------------------


def _summarize(
    run: _Run, results: Path, killed: dict[str, Any] | None, failures: list[str], wall: float, images: int
) -> dict[str, Any]:
    info = run.info
    assert info is not None
    world = run.dp * run.cp
    ranks = [
        _read_json(results / f"rank-{r}.json")
        or {"rank": r, "steps": [], "sources": [], "checksums": [], "bytes": 0, "error": "no result file"}
        for r in range(world)
    ]
    prod_records = sorted(
        (rec for p in results.glob("producer-*.json") if (rec := _read_json(p))),
        key=lambda rec: (rec["producer_id"], rec["incarnation"]),
    )
    attempts = sum(rec.get("metrics", {}).get("attempts", 0) for rec in prod_records)
    successes = sum(rec.get("metrics", {}).get("successes", 0) for rec in prod_records)
    conflicts = sum(rec.get("metrics", {}).get("conflicts", 0) for rec in prod_records)
    checks: list[dict[str, Any]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append({"name": name, "ok": bool(ok), "detail": detail})

    check(
        "processes",
        not failures and not any(r["error"] for r in ranks),
        "; ".join(failures + [f"rank {r['rank']}: {r['error']}" for r in ranks if r["error"]])
        or f"{len(run.shares)} producers and {world} ranks exited cleanly",
    )
    check(
        "namespace",
        info.steps == run.steps and info.end_of_stream,
        f"{info.steps} steps committed (expected {run.steps}), end of stream: {info.end_of_stream}",
    )

    expected = list(range(run.steps))
    bad = [r["rank"] for r in ranks if r["steps"] != expected]
    check(
        "step order",
        not bad,
        f"ranks {bad} did not see steps 0..{run.steps - 1} once each in order"
        if bad
        else f"all {world} ranks saw steps 0..{run.steps - 1} in order, no duplicate, no gap",
    )

    tgb_sources = [tuple(s[:2]) for s in ranks[0]["sources"]]
    disagree = sorted(
        {
            i
            for r in ranks
            for i, s in enumerate(r["sources"])
            if i >= len(tgb_sources) or tuple(s[:2]) != tgb_sources[i]
        }
    )
    wrong_slice = [r["rank"] for r in ranks if any(s[2] != r.get("slice_index") for s in r["sources"])]
    check(
        "same TGB per step",
        not disagree and not wrong_slice,
        (f"steps {disagree[:5]} differ across ranks; " if disagree else "")
        + (f"ranks {wrong_slice} got another rank's slice" if wrong_slice else "")
        or "every rank of every step read the same (producer, offset), each its own slice",
    )

    per_producer: dict[int, list[int]] = {}
    for p, o in tgb_sources:
        per_producer.setdefault(p, []).append(o)
    bad_prod = [
        producer_id(i)
        for i, share in enumerate(run.shares)
        if per_producer.get(i, []) != list(range(share))
        or info.producers.get(producer_id(i), {}).get("offset") != share
    ]
    check(
        "exactly-once offsets",
        not bad_prod,
        f"producers {bad_prod} have duplicate, missing or unordered offsets"
        if bad_prod
        else "each producer's committed offsets are exactly 0..k-1 ("
        + ", ".join(f"{producer_id(i)}: {share}" for i, share in enumerate(run.shares))
        + ")",
    )

    if killed is not None:
        pid = killed["producer_id"]
        restarted = [rec for rec in prod_records if rec["producer_id"] == pid and rec["incarnation"] > 0]
        resumed = restarted[0].get("resume_offset") if restarted else None
        killed["resumed_at"] = resumed
        killed["epoch_after"] = restarted[0].get("epoch") if restarted else None
        killed["redone_after_kill"] = killed["appended_before_kill"] - (resumed or 0)
        ok = resumed == killed["committed_at_kill"] and (killed["epoch_after"] or 0) > killed["epoch_before"]
        check(
            "resume after kill",
            ok,
            f"{pid} killed after appending {killed['appended_before_kill']} TGBs with "
            f"{killed['committed_at_kill']} committed; restarted incarnation resumed at {resumed} "
            f"(epoch {killed['epoch_before']} -> {killed['epoch_after']})",
        )

    # Payload integrity and determinism: regenerate sampled slices from their provenance
    # and compare with the checksum the rank computed on what it read from the store.
    samples: set[tuple[int, int]] = set()
    for step in range(0, run.steps, max(1, run.steps // 12)):
        samples.add((step, step % world))
    if killed is not None and killed.get("resumed_at") is not None:
        victim = int(killed["producer_id"].split("-")[1])
        for step, (p, o) in enumerate(tgb_sources):
            if p == victim and abs(o - killed["resumed_at"]) <= 1:
                samples.update((step, r) for r in range(world))
    mismatched = []
    for step, r in sorted(samples):
        rec = ranks[r]
        if step >= len(rec["sources"]):
            mismatched.append((step, r))
            continue
        p, o, s = rec["sources"][step]
        if slice_checksum(build_slice(p, o, s, images)) != rec["checksums"][step]:
            mismatched.append((step, r))
    check(
        "payload",
        not mismatched,
        f"{len(mismatched)} of {len(samples)} sampled slices differ from a regeneration: {mismatched[:5]}"
        if mismatched
        else f"{len(samples)} sampled slices regenerate bit-identically from their source offset",
    )

    mb = info.bytes / 1e6
    return {
        "ok": all(c["ok"] for c in checks),
        "url": run.url,
        "producers": len(run.shares),
        "dp": run.dp,
        "cp": run.cp,
        "steps": info.steps,
        "steps_expected": run.steps,
        "wall_time_s": round(wall, 2),
        "steps_per_s": round(info.steps / wall, 2) if wall > 0 else None,
        "mb_committed": round(mb, 2),
        "mb_per_s": round(mb / wall, 2) if wall > 0 else None,
        "mb_read_by_ranks": round(sum(r["bytes"] for r in ranks) / 1e6, 2),
        "log_version": info.latest_version,
        "commit_attempts": attempts,
        "commit_successes": successes,
        "commit_conflicts": conflicts,
        "commit_success_rate": round(successes / attempts, 4) if attempts else None,
        "killed": killed,
        "checks": checks,
    }


def render_summary(summary: dict[str, Any]) -> Any:
    """The summary as a rich table (what ``batchweave demo`` prints at the end)."""
    from rich.table import Table

    table = Table(title="BatchWeave demo summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    rate = summary["commit_success_rate"]
    rows = [
        ("steps", f"{summary['steps']} (expected {summary['steps_expected']}), log version {summary['log_version']}"),
        ("mesh", f"{summary['producers']} producers -> dp={summary['dp']} x cp={summary['cp']} ranks"),
        ("wall time", f"{summary['wall_time_s']:.2f} s"),
        (
            "throughput",
            f"{summary['steps_per_s']} steps/s, {summary['mb_per_s']} MB/s committed "
            f"({summary['mb_committed']} MB; ranks read {summary['mb_read_by_ranks']} MB)",
        ),
        (
            "commits",
            f"{summary['commit_successes']}/{summary['commit_attempts']} attempts succeeded "
            f"({'n/a' if rate is None else f'{rate:.1%}'}), {summary['commit_conflicts']} conflicts",
        ),
    ]
    k = summary["killed"]
    rows.append(
        (
            "killed",
            "no producer was killed"
            if k is None
            else f"{k['producer_id']} at {k['at_s']} s after appending {k['appended_before_kill']} TGBs "
            f"({k['committed_at_kill']} committed); resumed at offset {k['resumed_at']}, "
            f"epoch {k['epoch_before']} -> {k['epoch_after']}",
        )
    )
    for row in rows:
        table.add_row(*row)
    for c in summary["checks"]:
        mark = "[green]PASS[/]" if c["ok"] else "[red]FAIL[/]"
        table.add_row(f"check: {c['name']}", f"{mark} {c['detail']}")
    table.add_row("result", "[green]all checks passed[/]" if summary["ok"] else "[red]CHECKS FAILED[/]")
    if summary.get("directory"):
        table.add_row("namespace", f"{summary['url']}  (batchweave inspect {summary['url']})")
    return table
