"""Robot-episode video preprocessing: a LeRobot v2 dataset, decoded and packed at training time.

The workload of multimodal robot-learning models (vision-language-action models trained
on LeRobot data, or egocentric video at 2 frames per second as in HoloAssist): every
sample is a few seconds of several cameras' H.264 video plus the robot's states and
actions and a task text, and it becomes one fixed-length sequence of image patches,
text tokens and state/action rows. Decoding dominates and varies per sample (8 to 16
frames, and the decoder must start at the keyframe before the first wanted frame), and
the packed sequence is tens of times bigger than the compressed video it came from.

Used by ``examples/preprocess_video.py`` (as the sibling module ``lerobot_video``) and
by the benchmarks (as ``examples.lerobot_video``). It needs numpy, PyAV and pyarrow and
nothing of BatchWeave: every function is either pure or reads files under ``root``.

- ``write_dataset``: synthetic episodes in the LeRobot v2.1 layout, H.264 encoded here.
- ``sample_refs``: the training samples of a dataset (episode, start, frame count, task).
- ``decode_sample`` -> ``pack_sample`` = ``preprocess_sample``: one sample, one packed
  ``[seq_len, row_width]`` array (``packed_shape``).
- ``preprocess_step``: a global batch of samples as ``dp x cp`` slices, as a producer
  publishes them.
- ``expansion``: raw bytes read for some samples against ready-to-train bytes produced.
"""

from __future__ import annotations

import functools
import json
import math
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CODEBASE_VERSION = "v2.1"
CHUNKS_SIZE = 1000  # episodes per chunk directory, as LeRobot writes them
DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
_CAMERA_NAMES = ("cam_high", "cam_left_wrist", "cam_right_wrist", "cam_low")
TASKS = (
    "pick up the red cube and put it in the bin",
    "open the top drawer",
    "fold the towel in half",
    "stack the blue cup on the green cup",
    "push the button next to the lamp",
    "hand the screwdriver to the other arm",
    "wipe the table with the sponge",
    "insert the peg into the hole",
)

# Row kinds of a packed sequence (column 0 of every row).
PAD, PATCH, TEXT, STATE, ACTION = 0, 1, 2, 3, 4
META_COLUMNS = 4  # kind, camera, slot (frame slot or text position), patch index
# Byte-level tokenizer: ids 0..2 are special, a byte b is b + 3.
TOKEN_PAD, TOKEN_BOS, TOKEN_EOS, TOKEN_OFFSET = 0, 1, 2, 3


# -- specifications --------------------------------------------------------------------


@dataclass(frozen=True)
class EpisodeSpec:
    """What ``write_dataset`` generates: cameras, resolution, length and encoding of each episode."""

    cameras: int = 3
    height: int = 480
    width: int = 640
    fps: int = 30
    seconds: float = 12.0  # episode length
    crf: int = 23  # x264 constant rate factor: lower is better quality, bigger files
    gop: int = 30  # keyframe interval in frames (a decoder seeks to the keyframe before a wanted frame)
    state_dim: int = 14  # two 7-joint arms, as ALOHA
    action_dim: int = 14
    preset: str = "veryfast"  # x264 speed/size trade-off; generation only

    def __post_init__(self) -> None:
        if self.cameras < 1 or self.fps < 1 or self.gop < 1 or self.seconds <= 0:
            raise ValueError(f"{self}: cameras, fps, gop and seconds must be positive")
        if self.height % 2 or self.width % 2 or self.height < 16 or self.width < 16:
            raise ValueError(f"{self}: yuv420p needs even frame sides of 16 pixels or more")
        if not 0 <= self.crf <= 51:
            raise ValueError(f"{self}: crf must be in 0..51")

    @property
    def frames(self) -> int:
        """Frames per episode."""
        return round(self.fps * self.seconds)

    @property
    def camera_keys(self) -> list[str]:
        return camera_keys(self.cameras)


@dataclass(frozen=True)
class SampleSpec:
    """How a sample is drawn from an episode and packed into one training sequence."""

    sample_fps: float = 2.0  # frames per second kept from the video
    frames: tuple[int, int] = (8, 16)  # min and max frames per sample, drawn per sample
    image_size: int = 224  # model input side in pixels (shorter side resized, then center-cropped)
    history: int = 2  # states (up to each frame) and actions (from each frame) per frame slot
    patch: int = 16  # ViT patch side in pixels
    text_tokens: int = 32  # most task-text tokens kept (with begin and end tokens)
    seq_len: int = 9472  # rows of the packed sequence: 16 frames x 3 cameras x 196 patches + 64
    dtype: str = "float16"  # of the packed payload

    def __post_init__(self) -> None:
        low, high = self.frames
        if not 1 <= low <= high:
            raise ValueError(f"{self}: frames must be (min, max) with 1 <= min <= max")
        if self.sample_fps <= 0 or self.history < 1 or self.text_tokens < 2 or self.seq_len < 1:
            raise ValueError(f"{self}: sample_fps, history, seq_len must be positive, text_tokens >= 2")
        if self.image_size % self.patch:
            raise ValueError(f"{self}: image_size {self.image_size} is not a multiple of patch {self.patch}")
        if np.dtype(self.dtype).kind != "f":
            raise ValueError(f"{self}: dtype must be a float type, got {self.dtype}")

    @property
    def patches_per_frame(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def row_width(self) -> int:
        """Columns of a packed row: the metadata columns, then one patch's pixels."""
        return META_COLUMNS + 3 * self.patch * self.patch

    def to_dict(self) -> dict:
        return {**asdict(self), "frames": list(self.frames)}

    @classmethod
    def from_dict(cls, data: dict) -> SampleSpec:
        return cls(**{**data, "frames": tuple(data["frames"])})


@dataclass(frozen=True)
class DatasetInfo:
    """What ``write_dataset`` wrote."""

    root: Path
    spec: EpisodeSpec
    episodes: int
    total_frames: int
    video_bytes: int
    data_bytes: int
    tasks: tuple[str, ...]


@dataclass(frozen=True)
class SampleRef:
    """One training sample: ``frames`` frames of ``episode`` at ``sample_fps`` from ``start_s`` seconds."""

    episode: int
    start_s: float
    frames: int
    task: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SampleRef:
        return cls(**data)


@dataclass
class DecodedSample:
    """A sample after decoding, before packing."""

    ref: SampleRef
    frame_indices: np.ndarray  # [n] episode frame index of each frame slot
    images: np.ndarray  # uint8 [cameras, n, image_size, image_size, 3]
    states: np.ndarray  # float32 [n, history, state_dim]
    actions: np.ndarray  # float32 [n, history, action_dim]
    tokens: np.ndarray  # int32 [t] task text, with begin and end tokens
    raw_bytes: int = 0  # compressed video packets and Parquet rows this sample read
    decoded_frames: int = 0  # frames the decoder produced (all cameras), wanted or not


def camera_keys(cameras: int) -> list[str]:
    """LeRobot feature names of the cameras: ``observation.images.<camera>``."""
    names = [_CAMERA_NAMES[i] if i < len(_CAMERA_NAMES) else f"cam_{i}" for i in range(cameras)]
    return [f"observation.images.{name}" for name in names]


# -- writing a dataset ------------------------------------------------------------------


def write_dataset(root: Path, episodes: int, spec: EpisodeSpec, seed: int) -> DatasetInfo:
    """Synthetic multi-camera robot episodes in the LeRobot v2.1 layout under ``root``.

    ``meta/info.json``, ``meta/episodes.jsonl``, ``meta/tasks.jsonl``,
    ``meta/episodes_stats.jsonl``, one Parquet file of states and actions per episode and
    one H.264 MP4 per episode and camera. Deterministic per ``seed``; nothing downloaded.
    """
    if episodes < 1:
        raise ValueError(f"write_dataset needs at least one episode, got {episodes}")
    root = Path(root)
    rng = np.random.default_rng(seed)
    task_of = [int(t) for t in rng.integers(0, len(TASKS), size=episodes)]
    used_tasks = sorted(set(task_of))
    task_index = {t: i for i, t in enumerate(used_tasks)}
    video_bytes = data_bytes = 0
    stats = []
    for episode in range(episodes):
        episode_seed = [seed, episode]
        for camera, key in enumerate(spec.camera_keys):
            path = root / episode_video_path(episode, key)
            encode_episode_video(path, spec, camera, episode_seed)
            video_bytes += path.stat().st_size
        table = episode_table(spec, episode, episode * spec.frames, task_index[task_of[episode]], episode_seed)
        path = root / episode_data_path(episode)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        data_bytes += path.stat().st_size
        stats.append({"episode_index": episode, "stats": episode_stats(table)})
    tasks = tuple(TASKS[t] for t in used_tasks)
    meta = root / "meta"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "info.json").write_text(json.dumps(info_json(spec, episodes, len(tasks)), indent=2))
    write_jsonl(meta / "tasks.jsonl", [{"task_index": i, "task": task} for i, task in enumerate(tasks)])
    rows = [{"episode_index": e, "tasks": [TASKS[task_of[e]]], "length": spec.frames} for e in range(episodes)]
    write_jsonl(meta / "episodes.jsonl", rows)
    write_jsonl(meta / "episodes_stats.jsonl", stats)
    return DatasetInfo(root, spec, episodes, episodes * spec.frames, video_bytes, data_bytes, tasks)


def episode_data_path(episode: int) -> str:
    return DATA_PATH.format(episode_chunk=episode // CHUNKS_SIZE, episode_index=episode)


def episode_video_path(episode: int, video_key: str) -> str:
    return VIDEO_PATH.format(episode_chunk=episode // CHUNKS_SIZE, video_key=video_key, episode_index=episode)


def write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def info_json(spec: EpisodeSpec, episodes: int, tasks: int) -> dict:
    """``meta/info.json`` as LeRobot v2.1 writes it."""
    video = {
        "dtype": "video",
        "shape": [spec.height, spec.width, 3],
        "names": ["height", "width", "channels"],
        "info": {
            "video.fps": float(spec.fps),
            "video.height": spec.height,
            "video.width": spec.width,
            "video.channels": 3,
            "video.codec": "h264",
            "video.pix_fmt": "yuv420p",
            "video.is_depth_map": False,
            "has_audio": False,
        },
    }
    features: dict[str, dict] = {key: video for key in spec.camera_keys}
    features["observation.state"] = {
        "dtype": "float32",
        "shape": [spec.state_dim],
        "names": [f"joint_{i}" for i in range(spec.state_dim)],
    }
    features["action"] = {
        "dtype": "float32",
        "shape": [spec.action_dim],
        "names": [f"joint_{i}" for i in range(spec.action_dim)],
    }
    for name, dtype in (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64")):
        features[name] = {"dtype": dtype, "shape": [1], "names": None}
    for name in ("index", "task_index"):
        features[name] = {"dtype": "int64", "shape": [1], "names": None}
    return {
        "codebase_version": CODEBASE_VERSION,
        "robot_type": "synthetic_bimanual",
        "total_episodes": episodes,
        "total_frames": episodes * spec.frames,
        "total_tasks": tasks,
        "total_videos": episodes * spec.cameras,
        "total_chunks": (episodes - 1) // CHUNKS_SIZE + 1,
        "chunks_size": CHUNKS_SIZE,
        "fps": spec.fps,
        "splits": {"train": f"0:{episodes}"},
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH,
        "features": features,
        # Not LeRobot's: how the synthetic videos were encoded, so a reader can rebuild the spec.
        "batchweave_episode_spec": asdict(spec),
    }


def episode_table(spec: EpisodeSpec, episode: int, first_index: int, task_index: int, seed: list[int]) -> pa.Table:
    """One episode's Parquet rows: smooth joint trajectories; the action leads the state by a frame."""
    rng = np.random.default_rng([*seed, 1_000_003])
    n = spec.frames
    t = np.arange(n + 1, dtype=np.float64) / spec.fps
    dims = max(spec.state_dim, spec.action_dim)
    freq, phase, amp = rng.uniform(0.1, 0.6, dims), rng.uniform(0, 2 * np.pi, dims), rng.uniform(0.2, 1.2, dims)
    joints = (amp * np.sin(2 * np.pi * freq * t[:, None] + phase)).astype(np.float32)
    state, action = joints[:n, : spec.state_dim], joints[1:, : spec.action_dim]
    return pa.table(
        {
            "observation.state": fixed_list(state),
            "action": fixed_list(action),
            "timestamp": pa.array((np.arange(n) / spec.fps).astype(np.float32)),
            "frame_index": pa.array(np.arange(n, dtype=np.int64)),
            "episode_index": pa.array(np.full(n, episode, dtype=np.int64)),
            "index": pa.array(np.arange(first_index, first_index + n, dtype=np.int64)),
            "task_index": pa.array(np.full(n, task_index, dtype=np.int64)),
        }
    )


def fixed_list(values: np.ndarray) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])


def episode_stats(table: pa.Table) -> dict:
    """Per-episode min/max/mean/std/count of the numeric features (``meta/episodes_stats.jsonl``)."""
    out = {}
    for name in ("observation.state", "action", "timestamp", "frame_index"):
        values = column_array(table, name).astype(np.float64).reshape(len(table), -1)
        out[name] = {
            "min": values.min(0).tolist(),
            "max": values.max(0).tolist(),
            "mean": values.mean(0).tolist(),
            "std": values.std(0).tolist(),
            "count": [len(table)],
        }
    return out


def column_array(table: pa.Table, name: str) -> np.ndarray:
    """A column as numpy: ``[rows, dim]`` for a fixed-size list column, ``[rows]`` otherwise."""
    column = table.column(name).combine_chunks()
    if pa.types.is_fixed_size_list(column.type):
        return column.flatten().to_numpy().reshape(len(column), column.type.list_size)
    return column.to_numpy()


# -- synthetic frames -------------------------------------------------------------------


def index_bits(spec: EpisodeSpec) -> int:
    """Bits of the frame-index code drawn on every frame (enough for the episode's frames)."""
    return max(1, (spec.frames - 1).bit_length())


def center_square(height: int, width: int) -> tuple[int, int, int]:
    """(top, left, side) of the centered square that preprocessing keeps."""
    side = min(height, width)
    return (height - side) // 2, (width - side) // 2, side


def code_cells(side: int, bits: int) -> list[tuple[int, int, int, int]]:
    """(top, bottom, left, right) of each bit's cell, in the center square's coordinates.

    A band across the top of the square, 5% to 95% of its width, big enough to survive
    lossy encoding, resizing and chroma subsampling.
    """
    top, bottom = round(0.02 * side), max(round(0.14 * side), round(0.02 * side) + 2)
    edges = np.linspace(0.05 * side, 0.95 * side, bits + 1)
    return [(top, bottom, round(edges[b]), round(edges[b + 1])) for b in range(bits)]


def read_frame_index(square: np.ndarray, bits: int) -> int:
    """The frame index drawn on a frame, read back from its center square (any size, RGB)."""
    side = square.shape[0]
    value = 0
    for bit, (top, bottom, left, right) in enumerate(code_cells(side, bits)):
        height, width = bottom - top, right - left
        cell = square[top + height // 4 : bottom - height // 4, left + width // 4 : right - width // 4]
        if cell.mean() > 128:
            value |= 1 << bit
    return value


class SceneRenderer:
    """Frames of one camera: a gradient and a texture of its own, moving blobs, sensor noise.

    Compressible but not trivial, so that x264's CRF changes the file size as it does on
    real footage. Everything is precomputed once per camera; a frame costs a few array ops.
    """

    def __init__(self, spec: EpisodeSpec, camera: int, seed: list[int]) -> None:
        self.spec = spec
        rng = np.random.default_rng([*seed, camera])
        h, w = spec.height, spec.width
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        colors = rng.uniform(40, 215, size=(3, 3)).astype(np.float32)
        angle = rng.uniform(0, 2 * np.pi)
        ramp = (np.cos(angle) * x / w + np.sin(angle) * y / h + 1.5) / 3
        texture = np.sin(x / rng.uniform(6, 20)) * np.sin(y / rng.uniform(6, 20))
        background = colors[0] * ramp[..., None] + colors[1] * (1 - ramp[..., None]) + 18 * texture[..., None]
        self.background = background.astype(np.float32)
        self.blobs = [
            {
                "color": rng.uniform(0, 255, 3).astype(np.float32),
                "radius": rng.uniform(0.06, 0.16) * min(h, w),
                "center": rng.uniform(0.2, 0.8, 2) * (h, w),
                "swing": rng.uniform(0.05, 0.3, 2) * (h, w),
                "freq": rng.uniform(0.1, 0.5, 2),
                "phase": rng.uniform(0, 2 * np.pi, 2),
            }
            for _ in range(int(rng.integers(3, 6)))
        ]
        # Sensor noise of one grey level: with it the file size falls with the CRF as on camera
        # footage (1.5-1.7x per 5 CRF steps); stronger noise makes CRF 18 files blow up.
        self.noise = rng.normal(0, 1.0, size=(7, h, w, 1)).astype(np.float32)  # cycled: cheaper than fresh
        self.top, self.left, self.side = center_square(h, w)
        self.cells = code_cells(self.side, index_bits(spec))

    def frame(self, index: int) -> np.ndarray:
        """RGB uint8 ``[height, width, 3]`` of frame ``index``, with ``index`` drawn as a bit code."""
        t = index / self.spec.fps
        image = self.background + self.noise[index % len(self.noise)]
        h, w = self.spec.height, self.spec.width
        for blob in self.blobs:
            cy, cx = blob["center"] + blob["swing"] * np.sin(2 * np.pi * blob["freq"] * t + blob["phase"])
            r = blob["radius"]
            top, bottom = max(0, int(cy - r)), min(h, int(cy + r) + 1)
            left, right = max(0, int(cx - r)), min(w, int(cx + r) + 1)
            if top >= bottom or left >= right:
                continue
            yy, xx = np.ogrid[top:bottom, left:right]
            inside = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
            image[top:bottom, left:right][inside] = blob["color"]
        for bit, (c_top, c_bottom, c_left, c_right) in enumerate(self.cells):
            level = 255.0 if index >> bit & 1 else 0.0
            image[self.top + c_top : self.top + c_bottom, self.left + c_left : self.left + c_right] = level
        return np.clip(image, 0, 255).astype(np.uint8)


@functools.cache
def x264_cpu_param() -> str:
    """``:asm=AVX2`` on an x86 CPU with AVX-512, else nothing.

    With its AVX-512 routines, the x264 in PyAV's wheel gives other bytes for the same
    frames from one run to the next (its MB-tree rate control: seen at 96x64 and 160x128,
    even on one thread), and a dataset must be the same for a seed. Up to AVX2 it is
    bit-exact and as fast. x264 takes the list as given, without checking the CPU, so it
    is only set where the CPU has AVX-512 (and so AVX2).
    """
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return ""
    return ":asm=AVX2" if platform.machine() in ("x86_64", "AMD64") and "avx512f" in flags else ""


def encode_episode_video(path: Path, spec: EpisodeSpec, camera: int, seed: list[int]) -> None:
    """One camera's episode as H.264 yuv420p in MP4, a keyframe every ``gop`` frames exactly."""
    path.parent.mkdir(parents=True, exist_ok=True)
    renderer = SceneRenderer(spec, camera, seed)
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=spec.fps)
        stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
        stream.codec_context.time_base = Fraction(1, spec.fps)
        # No scene-cut keyframes: the keyframe interval is the knob, as it is in a seek-cost study.
        stream.options = {
            "crf": str(spec.crf),
            "preset": spec.preset,
            "x264-params": f"keyint={spec.gop}:min-keyint={spec.gop}:scenecut=0{x264_cpu_param()}",
        }
        for index in range(spec.frames):
            frame = av.VideoFrame.from_ndarray(renderer.frame(index), format="rgb24").reformat(format="yuv420p")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


# -- samples ----------------------------------------------------------------------------


def read_info(root: Path) -> dict:
    return json.loads((Path(root) / "meta" / "info.json").read_text())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class DatasetMeta:
    """What preprocessing needs from ``meta/``: frame rate, camera keys, episode lengths."""

    fps: float
    cameras: tuple[str, ...]
    lengths: dict[int, int]  # episode index -> frames


def read_meta(root: Path) -> DatasetMeta:
    """``meta/info.json`` and ``meta/episodes.jsonl``, parsed once per process and dataset version."""
    meta = Path(root) / "meta"
    stamps = tuple((meta / name).stat().st_mtime_ns for name in ("info.json", "episodes.jsonl"))
    return _read_meta(str(meta), stamps)


@functools.lru_cache(maxsize=16)
def _read_meta(meta: str, stamps: tuple[int, ...]) -> DatasetMeta:
    info = json.loads((Path(meta) / "info.json").read_text())
    cameras = tuple(key for key, feature in info["features"].items() if feature["dtype"] == "video")
    lengths = {row["episode_index"]: row["length"] for row in read_jsonl(Path(meta) / "episodes.jsonl")}
    return DatasetMeta(info["fps"], cameras, lengths)


def sample_refs(root: Path, sample: SampleSpec, seed: int, per_episode: int | None = None) -> list[SampleRef]:
    """The samples of the dataset at ``root``, shuffled; deterministic per ``seed``.

    Each sample draws its frame count in ``sample.frames``. By default each episode is
    cut into consecutive windows, each starting a random fraction of a sample period
    after the previous one ends, so the first wanted frame falls anywhere between two
    keyframes (the decoder's seek distance varies as in real data); a window that would
    run past the episode's end ends the episode's samples. With ``per_episode``, each
    episode gives that many windows at random starts instead, overlapping or not (as a
    sampler drawing clips at random does): many samples from a few episodes.
    """
    root = Path(root)
    fps = read_info(root)["fps"]
    rng = np.random.default_rng(seed)
    refs = []
    for row in read_jsonl(root / "meta" / "episodes.jsonl"):
        last = (row["length"] - 1) / fps  # time of the last frame
        if per_episode is None:
            windows = consecutive_windows(rng, last, sample)
        else:
            windows = random_windows(rng, last, sample, per_episode)
        refs.extend(SampleRef(row["episode_index"], start, frames, row["tasks"][0]) for start, frames in windows)
    if not refs:
        raise ValueError(f"{root}: no sample of {sample.frames[0]} frames at {sample.sample_fps} FPS fits an episode")
    order = rng.permutation(len(refs))
    return [refs[i] for i in order]


def consecutive_windows(rng: np.random.Generator, last_s: float, sample: SampleSpec) -> list[tuple[float, int]]:
    """(start, frames) of windows one after another, up to the last frame's time ``last_s``."""
    period, windows = 1.0 / sample.sample_fps, []
    start = float(rng.uniform(0, period))
    while True:
        frames = int(rng.integers(sample.frames[0], sample.frames[1] + 1))
        if start + (frames - 1) * period > last_s:
            return windows
        windows.append((round(start, 4), frames))
        start += frames * period + float(rng.uniform(0, period))


def random_windows(rng: np.random.Generator, last_s: float, sample: SampleSpec, count: int) -> list[tuple[float, int]]:
    """(start, frames) of ``count`` windows at random starts (fewer if some do not fit)."""
    period, windows = 1.0 / sample.sample_fps, []
    for _ in range(count):
        frames = int(rng.integers(sample.frames[0], sample.frames[1] + 1))
        if (frames - 1) * period <= last_s:
            windows.append((round(float(rng.uniform(0, last_s - (frames - 1) * period)), 4), frames))
    return windows


def wanted_frames(ref: SampleRef, sample: SampleSpec, fps: float, length: int) -> np.ndarray:
    """Episode frame indices nearest to the sample's times ``start + k / sample_fps``."""
    times = ref.start_s + np.arange(ref.frames) / sample.sample_fps
    return np.clip(np.rint(times * fps).astype(np.int64), 0, length - 1)


def decode_sample(root: Path, ref: SampleRef, sample: SampleSpec) -> DecodedSample:
    """Decode a sample: each camera's frames at the sample times, resized; states, actions, text."""
    root = Path(root)
    meta = read_meta(root)
    wanted = wanted_frames(ref, sample, meta.fps, meta.lengths[ref.episode])
    images, raw, decoded = [], 0, 0
    for key in meta.cameras:
        frames, read, count = decode_frames(root / episode_video_path(ref.episode, key), wanted, meta.fps)
        images.append(np.stack([resize_square(frames[i], sample.image_size) for i in wanted]))
        raw += read
        decoded += count
    states, actions, table_bytes = read_windows(root / episode_data_path(ref.episode), wanted, sample.history)
    return DecodedSample(
        ref=ref,
        frame_indices=wanted,
        images=np.stack(images),
        states=states,
        actions=actions,
        tokens=tokenize(ref.task, sample.text_tokens),
        raw_bytes=raw + table_bytes,
        decoded_frames=decoded,
    )


def decode_frames(path: Path, wanted: np.ndarray, fps: float) -> tuple[dict[int, av.VideoFrame], int, int]:
    """The frames of ``wanted`` indices, decoded from the keyframe before the first one.

    Returns (frame index -> frame, ``span_bytes`` of the frames from that keyframe to the
    last wanted one, frames decoded). One decoder thread: a producer is one process on
    one core, and a pool scales by processes.
    """
    last = int(wanted.max())
    keep = set(int(i) for i in wanted)
    frames: dict[int, av.VideoFrame] = {}
    sizes: dict[int, int] = {}
    decoded = 0
    with av.open(str(path)) as container:
        stream = seek_before(container, int(wanted.min()), fps)
        stream.codec_context.thread_count = 1
        for packet in container.demux(stream):
            if packet.pts is not None:
                sizes[frame_index(packet.pts, stream, fps)] = packet.size
            for frame in packet.decode():
                decoded += 1
                index = frame_index(frame.pts, stream, fps)
                if index in keep:
                    frames[index] = frame
                if index >= last:
                    return frames, span_bytes(sizes, last), decoded
    missing = sorted(keep - set(frames))
    if missing:
        raise ValueError(f"{path}: frames {missing} not found (the video has fewer frames than the episode)")
    return frames, span_bytes(sizes, last), decoded


def seek_before(container: av.container.InputContainer, first: int, fps: float) -> av.video.stream.VideoStream:
    """Seek the video stream to the nearest keyframe at or before frame ``first``; return the stream."""
    stream = container.streams.video[0]
    offset = int(Fraction(first) / Fraction(fps) / stream.time_base)
    container.seek((stream.start_time or 0) + offset, stream=stream, backward=True)
    return stream


def frame_index(pts: int, stream: av.video.stream.VideoStream, fps: float) -> int:
    return round(float((pts - (stream.start_time or 0)) * stream.time_base) * fps)


def span_bytes(sizes: dict[int, int], last: int) -> int:
    """Bytes of the packets (by frame index) from the first one read to frame ``last``."""
    return sum(size for index, size in sizes.items() if index <= last)


def resize_square(frame: av.VideoFrame, size: int) -> np.ndarray:
    """The shorter side resized to ``size`` (swscale, area averaging), then the centered square."""
    scale = size / min(frame.width, frame.height)
    width, height = max(size, round(frame.width * scale)), max(size, round(frame.height * scale))
    rgb = frame.reformat(width=width, height=height, format="rgb24", interpolation="AREA").to_ndarray()
    top, left = (height - size) // 2, (width - size) // 2
    return rgb[top : top + size, left : left + size]


def read_windows(path: Path, wanted: np.ndarray, history: int) -> tuple[np.ndarray, np.ndarray, int]:
    """States up to each wanted frame and actions from it, ``history`` each (edges repeated).

    Returns (states [n, history, state_dim], actions [n, history, action_dim], the bytes of
    the Parquet file attributed to the rows used).
    """
    table = pq.read_table(path, columns=["observation.state", "action"])
    states, actions = column_array(table, "observation.state"), column_array(table, "action")
    rows = len(table)
    offsets = np.arange(history)
    state_rows = np.clip(wanted[:, None] - offsets[::-1], 0, rows - 1)
    action_rows = np.clip(wanted[:, None] + offsets, 0, rows - 1)
    used = np.union1d(state_rows, action_rows).size
    return states[state_rows], actions[action_rows], math.ceil(path.stat().st_size * used / rows)


def tokenize(text: str, limit: int) -> np.ndarray:
    """A byte-level tokenizer: begin token, UTF-8 bytes (offset by 3), end token; at most ``limit`` ids."""
    body = [b + TOKEN_OFFSET for b in text.encode("utf-8")][: limit - 2]
    return np.array([TOKEN_BOS, *body, TOKEN_EOS], dtype=np.int32)


def detokenize(tokens: np.ndarray) -> str:
    return bytes(int(t) - TOKEN_OFFSET for t in tokens if t >= TOKEN_OFFSET).decode("utf-8", "replace")


# -- packing ----------------------------------------------------------------------------


def packed_shape(sample: SampleSpec) -> tuple[int, int]:
    """Shape of every packed sample: ``(seq_len, row_width)``."""
    return sample.seq_len, sample.row_width


def patchify(image: np.ndarray, patch: int) -> np.ndarray:
    """``[S, S, 3]`` -> ``[(S / patch)^2, patch * patch * 3]``, patches in row-major order."""
    side = image.shape[0] // patch
    grid = image.reshape(side, patch, side, patch, 3).transpose(0, 2, 1, 3, 4)
    return grid.reshape(side * side, patch * patch * 3)


def pack_sample(decoded: DecodedSample, sample: SampleSpec) -> np.ndarray:
    """One fixed-length multimodal sequence ``[seq_len, row_width]`` of ``sample.dtype``.

    Every row is one token: 4 metadata columns (kind, camera, slot, patch index) and a
    payload of ``3 * patch * patch`` values. The sequence is the task text (one row per
    token id, the id in the payload's first column), then per frame slot each camera's
    patches (pixels scaled to [-1, 1]), that slot's state window and its action window
    (flattened into one row each). Rows past ``seq_len`` are cut and a shorter sequence is
    padded with rows of zeros (kind PAD); the used length is the count of non-PAD rows,
    all at the front (``used_length``), for the attention and loss masks.
    """
    payload = 3 * sample.patch * sample.patch
    window = max(decoded.states[0].size, decoded.actions[0].size)
    if window > payload:
        raise ValueError(f"{sample}: a state/action window of {window} values does not fit a row of {payload}")
    blocks = [token_rows(decoded.tokens, payload)]
    for slot in range(len(decoded.frame_indices)):
        for camera in range(decoded.images.shape[0]):
            blocks.append(patch_rows(decoded.images[camera, slot], sample.patch, camera, slot))
        blocks.append(vector_row(STATE, slot, decoded.states[slot].reshape(-1), payload))
        blocks.append(vector_row(ACTION, slot, decoded.actions[slot].reshape(-1), payload))
    rows = np.concatenate(blocks)[: sample.seq_len]
    packed = np.zeros(packed_shape(sample), dtype=sample.dtype)
    packed[: len(rows)] = rows
    return packed


def token_rows(tokens: np.ndarray, payload: int) -> np.ndarray:
    rows = np.zeros((len(tokens), META_COLUMNS + payload), dtype=np.float32)
    rows[:, 0], rows[:, 2], rows[:, META_COLUMNS] = TEXT, np.arange(len(tokens)), tokens
    return rows


def patch_rows(image: np.ndarray, patch: int, camera: int, slot: int) -> np.ndarray:
    patches = patchify(image, patch).astype(np.float32) / 127.5 - 1.0
    meta = np.zeros((len(patches), META_COLUMNS), dtype=np.float32)
    meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3] = PATCH, camera, slot, np.arange(len(patches))
    return np.concatenate([meta, patches], axis=1)


def vector_row(kind: int, slot: int, values: np.ndarray, payload: int) -> np.ndarray:
    row = np.zeros((1, META_COLUMNS + payload), dtype=np.float32)
    row[0, 0], row[0, 2] = kind, slot
    row[0, META_COLUMNS : META_COLUMNS + values.size] = values
    return row


def used_length(packed: np.ndarray) -> int:
    """Rows of a packed sequence (or a CP chunk of one) that are not padding."""
    return int(np.count_nonzero(packed[..., 0] != PAD))


def preprocess_sample(root: Path, ref: SampleRef, sample: SampleSpec) -> np.ndarray:
    """``pack_sample(decode_sample(...))``: one sample, ready to train (``packed_shape(sample)``)."""
    return pack_sample(decode_sample(root, ref, sample), sample)


def preprocess_step(
    root: Path, refs: Sequence[SampleRef], sample: SampleSpec, dp: int, cp: int
) -> list[dict[str, np.ndarray]]:
    """A global batch of ``refs`` as ``dp * cp`` slices, slice ``(d, c)`` at ``d * cp + c``.

    Rank ``d`` of data parallelism gets ``len(refs) / dp`` consecutive samples; context
    parallelism ``c`` of ``cp`` gets chunk ``c`` of each sequence (``seq_len / cp`` rows).
    Each slice: ``tokens`` ``[B, seq_len / cp, row_width]`` and ``lengths`` ``int32 [B]``,
    the used length of each whole sequence (the same in every chunk of it).
    """
    if len(refs) % dp or not refs:
        raise ValueError(f"a global batch of {len(refs)} samples does not split over dp={dp}")
    if sample.seq_len % cp:
        raise ValueError(f"seq_len {sample.seq_len} does not split over cp={cp}")
    packed = np.stack([preprocess_sample(root, ref, sample) for ref in refs])
    lengths = np.array([used_length(p) for p in packed], dtype=np.int32)
    per_rank, chunk = len(refs) // dp, sample.seq_len // cp
    return [
        {
            "tokens": np.ascontiguousarray(packed[d * per_rank : (d + 1) * per_rank, c * chunk : (c + 1) * chunk]),
            "lengths": lengths[d * per_rank : (d + 1) * per_rank],
        }
        for d in range(dp)
        for c in range(cp)
    ]


# -- expansion --------------------------------------------------------------------------


def sample_raw_bytes(root: Path, ref: SampleRef, sample: SampleSpec) -> int:
    """Bytes a sample reads: video packets from the seek keyframe to its last frame, and its Parquet rows.

    Demuxing only (no decoding), so it is cheap; ``decode_sample`` counts the same bytes.
    """
    root = Path(root)
    meta = read_meta(root)
    wanted = wanted_frames(ref, sample, meta.fps, meta.lengths[ref.episode])
    total = 0
    for key in meta.cameras:
        total += packet_bytes(root / episode_video_path(ref.episode, key), wanted, meta.fps)
    return total + read_windows(root / episode_data_path(ref.episode), wanted, sample.history)[2]


def packet_bytes(path: Path, wanted: np.ndarray, fps: float) -> int:
    """``span_bytes`` of ``decode_frames``, by demuxing alone: the packets of every frame from
    the keyframe before the first wanted frame to the last one (B-frames come in decode
    order, so the walk ends once every index of that span has been seen)."""
    last = int(wanted.max())
    sizes: dict[int, int] = {}
    with av.open(str(path)) as container:
        stream = seek_before(container, int(wanted.min()), fps)
        for packet in container.demux(stream):
            if packet.pts is None:
                continue
            index = frame_index(packet.pts, stream, fps)
            sizes[index] = packet.size
            if index <= last and sum(1 for i in sizes if i <= last) == last - min(sizes) + 1:
                break
    return span_bytes(sizes, last)


def expansion(root: Path, refs: Sequence[SampleRef], sample: SampleSpec) -> dict:
    """Raw bytes read for ``refs`` against ready-to-train bytes produced from them.

    ``raw_bytes``: per sample, the compressed packets the decoder reads (from the keyframe
    before its first frame to its last) and the Parquet bytes of its rows, summed.
    ``episode_bytes``: the whole MP4 and Parquet files of the episodes touched, once each.
    ``ready_bytes``: the packed arrays. The ratios are ready over raw.
    """
    root = Path(root)
    cameras = read_meta(root).cameras
    raw = sum(sample_raw_bytes(root, ref, sample) for ref in refs)
    episodes = sorted({ref.episode for ref in refs})
    episode_bytes = 0
    for episode in episodes:
        episode_bytes += (root / episode_data_path(episode)).stat().st_size
        episode_bytes += sum((root / episode_video_path(episode, key)).stat().st_size for key in cameras)
    ready = len(refs) * math.prod(packed_shape(sample)) * np.dtype(sample.dtype).itemsize
    return {
        "samples": len(refs),
        "episodes": len(episodes),
        "raw_bytes": raw,
        "episode_bytes": episode_bytes,
        "ready_bytes": ready,
        "expansion": ready / raw if raw else math.inf,
        "expansion_vs_episodes": ready / episode_bytes if episode_bytes else math.inf,
    }


# -- producer pools -------------------------------------------------------------------


def global_batches(refs: Sequence[SampleRef], batch: int) -> list[list[SampleRef]]:
    """``refs`` in global batches of ``batch`` samples, in order; an incomplete last batch is dropped."""
    if batch < 1:
        raise ValueError(f"a global batch needs at least one sample, got {batch}")
    return [list(refs[i : i + batch]) for i in range(0, len(refs) - batch + 1, batch)]


def step_item(root: Path, refs: Sequence[SampleRef], sample: SampleSpec, dp: int, cp: int) -> dict:
    """One global batch as a pool shard: plain values (a pool fingerprints and ships them)."""
    return {"root": str(root), "refs": [r.to_dict() for r in refs], "sample": sample.to_dict(), "dp": dp, "cp": cp}


def preprocess_item(item: dict) -> list[dict[str, np.ndarray]]:
    """``preprocess_step`` of a ``step_item``: the ``preprocess`` function of a producer pool."""
    refs = [SampleRef.from_dict(r) for r in item["refs"]]
    return preprocess_step(Path(item["root"]), refs, SampleSpec.from_dict(item["sample"]), item["dp"], item["cp"])


def episode_spec(root: Path) -> EpisodeSpec:
    """The ``EpisodeSpec`` a dataset was written with (from ``meta/info.json``)."""
    return EpisodeSpec(**read_info(root)["batchweave_episode_spec"])
