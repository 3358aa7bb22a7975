"""The demo's workload: synthetic "raw images" preprocessed into one rank's slice.

What a real data pipeline does to each image, on made-up photos: decode, resize to
``RESOLUTION`` x ``RESOLUTION``, normalize, tokenize, pack. Every slice is a pure function
of (producer, source offset, slice index), so the checks can regenerate any slice a rank
received and compare it bit for bit.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import numpy as np

IMAGES_PER_SLICE = 8  # per-rank micro-batch of images
RESOLUTION = 32  # images are resized to RESOLUTION x RESOLUTION
SEQ_LEN = 256  # packed token rows are [IMAGES_PER_SLICE // 2, SEQ_LEN]
PAD, BOS, EOS = 0, 257, 258  # token ids; pixel tokens are 1..256
_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)  # the usual ImageNet statistics
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
WRITER_EPOCH = "writer_epoch"  # added to every slice: which incarnation wrote it


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


def payload_checksum(data: dict[str, np.ndarray]) -> str:
    """The checksum of what preprocessing made: the writer's epoch is not part of it."""
    return slice_checksum({k: v for k, v in data.items() if k != WRITER_EPOCH})
