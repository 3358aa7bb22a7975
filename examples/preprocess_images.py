"""Image preprocessing with a producer pool: JPEG decode, random-resized crop, flip, normalize.

    python examples/preprocess_images.py --data /tmp/image-run --producers 2 --dp 2

What it does, end to end, with nothing downloaded:
1. Encodes synthetic images (seeded gradients, rings and noise at several sizes) as JPEG
   files with Pillow, ``--images-per-shard`` to a shard directory.
2. Runs ``batchweave.run_pool`` over the shard directories. Each worker decodes every
   JPEG, takes a random-resized crop (scale 0.08-1, aspect 3/4-4/3, as torchvision's
   RandomResizedCrop), resizes it to ``--size`` pixels, flips it horizontally half the
   time, and normalizes with the ImageNet mean and standard deviation. The randomness is
   seeded by the shard's name, so a rerun or a restarted worker produces the same bytes.
   The shard's images are split evenly over ``dp`` slices (``cp`` is 1 for images).
3. Reads the namespace back as rank 0 would and checks the shapes and statistics.

Decoding and resampling dominate the cost here, not I/O: that is the workload producer
pools exist to scale out.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import math
import random
from pathlib import Path

import numpy as np
from PIL import Image

import batchweave as bw

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def write_images(directory: Path, shards: int, per_shard: int, seed: int = 0) -> list[Path]:
    """Shard directories of synthetic JPEGs of varied sizes."""
    rng = np.random.default_rng(seed)
    paths = []
    for shard in range(shards):
        shard_dir = directory / f"shard-{shard:04d}"
        shard_dir.mkdir(parents=True, exist_ok=True)
        for index in range(per_shard):
            height, width = (int(v) for v in rng.integers(160, 480, size=2))
            y, x = np.mgrid[0:height, 0:width]
            rings = np.sin(np.hypot(y - height / 2, x - width / 2) / rng.uniform(4, 20))
            pixels = np.stack([x / width, y / height, (rings + 1) / 2], axis=-1)
            pixels = np.clip(pixels + rng.normal(0, 0.05, pixels.shape), 0, 1)
            Image.fromarray((pixels * 255).astype(np.uint8)).save(shard_dir / f"{index:04d}.jpg", quality=90)
        paths.append(shard_dir)
    return paths


def random_resized_crop(image: Image.Image, size: int, rng: random.Random) -> Image.Image:
    """torchvision's RandomResizedCrop, in plain Pillow: area and aspect ratio drawn at random."""
    width, height = image.size
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        crop_w, crop_h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            left, top = rng.randint(0, width - crop_w), rng.randint(0, height - crop_h)
            return image.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + crop_w, top + crop_h))
    side = min(width, height)  # fallback: the central square
    box = ((width - side) // 2, (height - side) // 2, (width + side) // 2, (height + side) // 2)
    return image.resize((size, size), Image.Resampling.BILINEAR, box=box)


def augment(jpeg: bytes, size: int, rng: random.Random) -> np.ndarray:
    """Decode one JPEG (the cost), random-resized crop, flip half the time, normalize:
    ``[3, size, size]`` float32, channels first as training expects. ``bench e2e``'s
    image pipeline is this too."""
    with Image.open(io.BytesIO(jpeg)) as decoded:
        crop = random_resized_crop(decoded.convert("RGB"), size, rng)
    if rng.random() < 0.5:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return ((np.asarray(crop, dtype=np.float32) / 255.0 - MEAN) / STD).transpose(2, 0, 1)


def augment_shard(item: tuple[str, int, int]) -> list[dict[str, np.ndarray]]:
    """One shard directory -> one TGB: ``dp`` slices of normalized ``[n, 3, size, size]`` images."""
    shard_dir, dp, size = item
    rng = random.Random(hashlib.sha256(Path(shard_dir).name.encode()).digest())  # same crops on every rerun
    batch = np.stack([augment(path.read_bytes(), size, rng) for path in sorted(Path(shard_dir).glob("*.jpg"))])
    if len(batch) % dp:
        raise ValueError(f"{shard_dir}: {len(batch)} images do not split evenly over dp={dp}")
    return [{"images": part, "index": np.arange(d, len(batch), dp)} for d, part in enumerate(np.split(batch, dp))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="working directory (images, namespace)")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--images-per-shard", type=int, default=16, help="a multiple of --dp")
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--size", type=int, default=224, help="output side in pixels")
    args = parser.parse_args(argv)
    if args.images_per_shard % args.dp:
        parser.error("--images-per-shard must be a multiple of --dp")

    shards = write_images(args.data / "images", args.shards, args.images_per_shard)
    url = str(args.data / "namespace")
    source = [(str(path), args.dp, args.size) for path in shards]
    report = bw.run_pool(url, "images", source, augment_shard, producers=args.producers, dp=args.dp, end_of_stream=True)
    print(f"committed {report.produced} TGBs from {len(shards)} shards in {report.seconds:.1f} s")

    with bw.Consumer(url, dp=args.dp, rank=0, timeout_s=30) as rank0:
        steps = [batch.data["images"] for batch in rank0]
    pixels = np.concatenate(steps)
    print(
        f"rank 0 read {len(steps)} steps of {steps[0].shape}; pixel mean {pixels.mean():+.3f}, std {pixels.std():.3f}"
    )
    expected = (args.images_per_shard // args.dp, 3, args.size, args.size)
    return 0 if len(steps) == args.shards and steps[0].shape == expected else 1


if __name__ == "__main__":
    raise SystemExit(main())
