"""Image-text samples as an OpenCLIP-style training run sees them, for ``bench video``'s
image-text panel (the paper's Fig. 1b): a JPEG and its caption in, float tensors out.

A sample is what a WebDataset shard of LAION-style data holds: a JPEG photo (web sizes,
shorter side 384 to 768 pixels, quality 80 to 95) and a caption. The images are
synthetic but compress like photos: smooth colour gradients, soft-edged shapes, a little
texture and sensor-like noise (flat colour would compress hundreds of times, pure noise
hardly at all). Preprocessing is OpenCLIP's evaluation transform: the shorter side
resized to ``size`` (bicubic), the centred square cropped, scaled to [0, 1] and
normalized with OpenAI CLIP's mean and standard deviation, as float32 ``[3, size, size]``;
the caption becomes CLIP's 77 token ids as int64 (a byte-level tokenizer stands in for
CLIP's BPE: the tensor has the same shape and bytes).

Pure functions and in-memory bytes; nothing is downloaded or written to disk.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

__all__ = ["CONTEXT_LENGTH", "ImageTextSample", "caption_tokens", "make_samples", "preprocess", "raw_bytes"]

# OpenAI CLIP's normalization (open_clip.constants.OPENAI_DATASET_MEAN / _STD).
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)
CONTEXT_LENGTH = 77  # CLIP's text context: every caption becomes 77 token ids
TOKEN_PAD, TOKEN_BOS, TOKEN_EOS, TOKEN_OFFSET = 0, 1, 2, 3  # byte b is token b + 3
ASPECTS = (1.0, 4 / 3, 3 / 2, 16 / 9)  # common photo aspect ratios
_ADJECTIVES = ("red", "small", "old", "wooden", "shiny", "striped", "blue", "green", "empty", "crowded")
_NOUNS = ("cup", "bicycle", "dog", "kitchen", "mountain", "sofa", "street", "boat", "lamp", "garden")
_PLACES = ("on a table", "in the morning light", "next to a window", "at the beach", "in a city park", "at night")


@dataclass(frozen=True, slots=True)
class ImageTextSample:
    """One training sample as stored: the JPEG file's bytes and the caption's text."""

    jpeg: bytes
    caption: str


def raw_bytes(sample: ImageTextSample) -> int:
    """What the sample costs to read: its JPEG and its UTF-8 caption (a shard's two members)."""
    return len(sample.jpeg) + len(sample.caption.encode("utf-8"))


def make_samples(count: int, seed: int, shorter_side: tuple[int, int] = (384, 768)) -> list[ImageTextSample]:
    """``count`` synthetic photo-like JPEGs with captions; deterministic per ``seed``."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(count):
        short = int(rng.integers(shorter_side[0], shorter_side[1] + 1))
        long = round(short * float(rng.choice(ASPECTS)))
        height, width = (short, long) if rng.random() < 0.7 else (long, short)  # most photos are landscape
        buffer = io.BytesIO()
        quality = int(rng.integers(80, 96))
        Image.fromarray(synthetic_photo(rng, height, width)).save(buffer, format="JPEG", quality=quality)
        samples.append(ImageTextSample(buffer.getvalue(), synthetic_caption(rng)))
    return samples


def synthetic_photo(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """RGB uint8 ``[height, width, 3]``: gradient, soft shapes, texture and noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    y, x = y / height, x / width
    top, bottom = rng.uniform(30, 225, size=(2, 3)).astype(np.float32)
    image = top + (bottom - top) * (0.6 * y + 0.4 * x)[..., None]
    for _ in range(int(rng.integers(3, 8))):
        cy, cx, ry, rx = rng.uniform(0.1, 0.9, 2).tolist() + rng.uniform(0.05, 0.3, 2).tolist()
        distance = ((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2
        weight = 1 / (1 + np.exp(np.minimum(12 * (distance - 1), 50)))  # a soft edge, as out of focus
        image += weight[..., None] * (rng.uniform(0, 255, 3).astype(np.float32) - image)
    frequency = rng.uniform(20, 80, 2)
    image += 10 * (np.sin(frequency[0] * x) * np.sin(frequency[1] * y))[..., None]
    image += rng.normal(0, 3.0, size=(height, width, 1)).astype(np.float32)  # sensor noise, one grey level or so
    return np.clip(image, 0, 255).astype(np.uint8)


def synthetic_caption(rng: np.random.Generator) -> str:
    adjective, noun, place = (str(rng.choice(words)) for words in (_ADJECTIVES, _NOUNS, _PLACES))
    return f"a photo of a {adjective} {noun} {place}"


def preprocess(sample: ImageTextSample, size: int) -> dict[str, np.ndarray]:
    """OpenCLIP's transform at ``size`` px: ``image`` float32 ``[3, size, size]``, ``text`` int64 ``[77]``."""
    with Image.open(io.BytesIO(sample.jpeg)) as stored:
        image = stored.convert("RGB")
    width, height = image.size
    scale = size / min(width, height)
    resized = image.resize(
        (max(size, round(width * scale)), max(size, round(height * scale))), Image.Resampling.BICUBIC
    )
    left, top = (resized.width - size) // 2, (resized.height - size) // 2
    square = resized.crop((left, top, left + size, top + size))
    pixels = (np.asarray(square, dtype=np.float32) / 255.0 - CLIP_MEAN) / CLIP_STD
    return {"image": np.ascontiguousarray(pixels.transpose(2, 0, 1)), "text": caption_tokens(sample.caption)}


def caption_tokens(caption: str) -> np.ndarray:
    """int64 ``[77]``: begin token, the caption's UTF-8 bytes (cut to fit), end token, padding."""
    body = [b + TOKEN_OFFSET for b in caption.encode("utf-8")][: CONTEXT_LENGTH - 2]
    tokens = np.full(CONTEXT_LENGTH, TOKEN_PAD, dtype=np.int64)
    tokens[: len(body) + 2] = [TOKEN_BOS, *body, TOKEN_EOS]
    return tokens
