"""``bench video``'s expansion pieces: OpenCLIP-style image-text preprocessing on synthetic
JPEGs, and a robot-video sequence sized to hold exactly what its configuration keeps."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from benchmarks import expansion_images as ei
from benchmarks.video import fitted_sample
from examples import lerobot_video as lv


def jpeg(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def test_preprocess_is_openclips_transform():
    # A wide image, black on the left and white on the right of its centre: the shorter
    # side is resized to 40 px and the centred square kept, so the crop is half and half.
    pixels = np.zeros((100, 300, 3), dtype=np.uint8)
    pixels[:, 150:] = 255
    sample = ei.ImageTextSample(jpeg(pixels), "a photo of a cup")
    out = ei.preprocess(sample, 40)
    image, text = out["image"], out["text"]
    assert image.shape == (3, 40, 40) and image.dtype == np.float32 and image.flags.c_contiguous
    black, white = (0 - ei.CLIP_MEAN) / ei.CLIP_STD, (1 - ei.CLIP_MEAN) / ei.CLIP_STD
    np.testing.assert_allclose(image[:, :, :15].mean(axis=(1, 2)), black, atol=0.05)
    np.testing.assert_allclose(image[:, :, 25:].mean(axis=(1, 2)), white, atol=0.05)
    assert text.shape == (ei.CONTEXT_LENGTH,) and text.dtype == np.int64
    body = len("a photo of a cup")
    assert text[0] == ei.TOKEN_BOS and text[body + 1] == ei.TOKEN_EOS and not text[body + 2 :].any()
    assert bytes(int(t) - ei.TOKEN_OFFSET for t in text[1 : body + 1]).decode() == "a photo of a cup"


def test_a_long_caption_is_cut_to_clips_context():
    tokens = ei.caption_tokens("x" * 500)
    assert tokens.shape == (77,) and tokens[0] == ei.TOKEN_BOS and tokens[-1] == ei.TOKEN_EOS


def test_samples_are_deterministic_and_compress_like_photos():
    samples = ei.make_samples(4, seed=3, shorter_side=(96, 160))
    assert samples == ei.make_samples(4, seed=3, shorter_side=(96, 160))
    assert samples != ei.make_samples(4, seed=4, shorter_side=(96, 160))
    for sample in samples:
        with Image.open(io.BytesIO(sample.jpeg)) as image:
            assert image.format == "JPEG" and 96 <= min(image.size) <= 160
            pixels = image.size[0] * image.size[1]
        # Photos at quality 80-95 take a few tenths of a byte per pixel: flat colour takes
        # far less, noise several bytes.
        assert 0.05 < len(sample.jpeg) / pixels < 1.5, len(sample.jpeg) / pixels
        assert ei.raw_bytes(sample) == len(sample.jpeg) + len(sample.caption)


@pytest.mark.parametrize(("image_size", "frames"), [(16, 1), (32, 3)])
def test_a_fitted_sequence_holds_every_kept_frame_and_no_padding(tmp_path, image_size, frames):
    episode = lv.EpisodeSpec(cameras=2, height=48, width=64, fps=10, seconds=2.0, gop=10)
    lv.write_dataset(tmp_path, 1, episode, seed=0)
    base = lv.SampleSpec(patch=8, text_tokens=8)  # every task's text fills 8 tokens
    sample = fitted_sample(base, episode.cameras, image_size, frames, sample_fps=float(episode.fps))
    (ref, *_) = lv.sample_refs(tmp_path, sample, seed=0, per_episode=2)
    packed = lv.pack_sample(lv.decode_sample(tmp_path, ref, sample), sample)
    assert packed.shape[0] == sample.seq_len == lv.used_length(packed)  # no padding row
    assert packed[-1, 0] == lv.ACTION and packed[-1, 2] == frames - 1  # nothing cut: the last slot's action
