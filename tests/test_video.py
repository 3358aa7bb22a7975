"""The video workload (examples/lerobot_video.py, examples/preprocess_video.py) on tiny episodes:
the LeRobot layout, the frames a sample decodes, the packing, and a producer pool publishing it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchweave as bw
from examples import lerobot_video as lv

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "preprocess_video.py"
# 30 frames per episode, a keyframe every 5: seeks land mid-GOP.
EPISODE = lv.EpisodeSpec(cameras=2, height=48, width=64, fps=10, seconds=3.0, gop=5, state_dim=3, action_dim=2)
# 2-FPS samples are every 5th frame; 2 cameras x 16 patches per frame.
SAMPLE = lv.SampleSpec(frames=(2, 3), image_size=32, patch=8, history=2, text_tokens=12, seq_len=128)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("video") / "dataset"
    lv.write_dataset(root, 3, EPISODE, seed=7)
    return root


def test_layout_is_lerobot_v2(dataset):
    info = json.loads((dataset / "meta" / "info.json").read_text())
    assert info["codebase_version"].startswith("v2.") and info["fps"] == 10
    assert (info["total_episodes"], info["total_frames"], info["total_videos"]) == (3, 90, 6)
    assert info["chunks_size"] == 1000 and info["splits"] == {"train": "0:3"}
    features = info["features"]
    cameras = ["observation.images.cam_high", "observation.images.cam_left_wrist"]
    assert [k for k, f in features.items() if f["dtype"] == "video"] == cameras
    assert features[cameras[0]]["shape"] == [48, 64, 3]
    assert features[cameras[0]]["info"]["video.codec"] == "h264"
    assert features["observation.state"] == {
        "dtype": "float32",
        "shape": [3],
        "names": ["joint_0", "joint_1", "joint_2"],
    }
    assert features["action"]["shape"] == [2] and features["index"]["dtype"] == "int64"
    episodes = lv.read_jsonl(dataset / "meta" / "episodes.jsonl")
    tasks = {t["task"]: t["task_index"] for t in lv.read_jsonl(dataset / "meta" / "tasks.jsonl")}
    assert [(e["episode_index"], e["length"]) for e in episodes] == [(0, 30), (1, 30), (2, 30)]
    assert len(lv.read_jsonl(dataset / "meta" / "episodes_stats.jsonl")) == 3

    for episode in episodes:
        index = episode["episode_index"]
        data = info["data_path"].format(episode_chunk=0, episode_index=index)
        table = pq.read_table(dataset / data)
        assert table.schema.field("observation.state").type.list_size == 3
        action = table.schema.field("action").type
        assert (action.list_size, action.value_type) == (2, pa.float32())
        assert table.column("frame_index").to_pylist() == list(range(30))
        assert table.column("index").to_pylist() == list(range(30 * index, 30 * index + 30))
        assert np.allclose(table.column("timestamp").to_numpy(), np.arange(30) / 10)
        assert set(table.column("task_index").to_pylist()) == {tasks[episode["tasks"][0]]}
        for key in cameras:
            video = info["video_path"].format(episode_chunk=0, video_key=key, episode_index=index)
            with av.open(str(dataset / video)) as container:
                stream = container.streams.video[0]
                assert (stream.codec_context.name, stream.format.name) == ("h264", "yuv420p")
                keyframes = [p.is_keyframe for p in container.demux(stream) if p.pts is not None]
                container.seek(0)
                frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
            assert len(frames) == 30 and frames[0].shape == (48, 64, 3)
            assert sum(keyframes) == 6  # exactly every gop = 5 frames


def test_the_decoded_frames_are_the_ones_at_the_sample_times(dataset):
    bits = lv.index_bits(lv.episode_spec(dataset))
    refs = [
        lv.SampleRef(0, 0.0, 3, "t"),  # from the first keyframe
        lv.SampleRef(1, 0.74, 3, "t"),  # 0.74 s -> frame 7 (mid-GOP), 12, 17
        lv.SampleRef(2, 2.36, 2, "t"),  # 24 (mid-GOP, decoded from 20), 29: the last frame
    ]
    for ref in refs:
        decoded = lv.decode_sample(dataset, ref, SAMPLE)
        expected = [round((ref.start_s + k / 2) * 10) for k in range(ref.frames)]
        assert decoded.frame_indices.tolist() == expected
        for camera in range(2):
            assert [lv.read_frame_index(image, bits) for image in decoded.images[camera]] == expected
        # It seeks to the keyframe at or before the first frame and stops at the last one.
        assert decoded.decoded_frames == 2 * (expected[-1] - expected[0] // 5 * 5 + 1)
        assert decoded.raw_bytes == lv.sample_raw_bytes(dataset, ref, SAMPLE) > 0
    cameras = lv.decode_sample(dataset, refs[0], SAMPLE).images
    assert np.abs(cameras[0].astype(int) - cameras[1].astype(int)).mean() > 20  # a scene per camera


def test_lower_crf_gives_bigger_files(tmp_path):
    sizes = []
    for crf in (18, 23, 28, 35):
        path = tmp_path / f"crf{crf}.mp4"
        lv.encode_episode_video(path, lv.EpisodeSpec(height=48, width=64, fps=10, seconds=2, crf=crf), 0, [0])
        sizes.append(path.stat().st_size)
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 2 * sizes[-1], sizes


def digest(root: Path) -> dict[str, str]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_dataset_samples_and_preprocessing_are_deterministic(dataset, tmp_path):
    lv.write_dataset(tmp_path / "same", 3, EPISODE, seed=7)
    lv.write_dataset(tmp_path / "other", 3, EPISODE, seed=8)
    assert digest(tmp_path / "same") == digest(dataset)
    other = digest(tmp_path / "other")
    assert other.keys() == digest(dataset).keys() and other != digest(dataset)

    refs = lv.sample_refs(dataset, SAMPLE, seed=1)
    assert refs == lv.sample_refs(dataset, SAMPLE, seed=1) != lv.sample_refs(dataset, SAMPLE, seed=2)
    drawn = lv.sample_refs(dataset, SAMPLE, seed=1, per_episode=5)
    assert len(drawn) == 15 and drawn == lv.sample_refs(dataset, SAMPLE, seed=1, per_episode=5)
    for ref in refs + drawn:
        assert 2 <= ref.frames <= 3 and ref.start_s + (ref.frames - 1) / 2 <= 2.9  # inside the episode
    packed = lv.preprocess_sample(dataset, refs[0], SAMPLE)
    assert packed.shape == lv.packed_shape(SAMPLE) == (128, 4 + 3 * 8 * 8) and packed.dtype == np.float16
    assert packed.tobytes() == lv.preprocess_sample(tmp_path / "same", refs[0], SAMPLE).tobytes()


def test_packing_puts_text_patches_states_and_actions_in_one_sequence(dataset):
    ref = lv.SampleRef(1, 0.74, 3, "fold the towel in half")
    decoded = lv.decode_sample(dataset, ref, SAMPLE)
    packed = lv.pack_sample(decoded, SAMPLE).astype(np.float32)
    kinds = packed[:, 0].astype(int).tolist()
    text = 12  # the text is cut to 12 tokens, begin and end included
    per_slot = [lv.PATCH] * 32 + [lv.STATE, lv.ACTION]
    used = text + 3 * len(per_slot)
    assert kinds == [lv.TEXT] * text + per_slot * 3 + [lv.PAD] * (128 - used)
    assert lv.used_length(packed) == used and not packed[used:].any()
    assert lv.detokenize(packed[:text, 4]) == "fold the t"
    slot1_camera1 = packed[text + 34 + 16 : text + 34 + 32]  # slot 1, camera 1's 16 patches
    assert (slot1_camera1[:, 1:4] == np.c_[np.ones(16), np.ones(16), np.arange(16)]).all()
    pixels = np.rint((slot1_camera1[:, 4:] + 1) * 127.5).astype(np.uint8)
    image = pixels.reshape(4, 4, 8, 8, 3).transpose(0, 2, 1, 3, 4).reshape(32, 32, 3)
    assert (image == decoded.images[1, 1]).all()  # float16 keeps every pixel level exactly

    table = pq.read_table(dataset / lv.episode_data_path(1))
    states, actions = lv.column_array(table, "observation.state"), lv.column_array(table, "action")
    state_row, action_row = packed[text + 2 * 34 - 2], packed[text + 2 * 34 - 1]  # slot 1 = frame 12
    assert np.allclose(state_row[4:10], states[[11, 12]].reshape(-1), atol=2e-3)  # up to the frame
    assert np.allclose(action_row[4:8], actions[[12, 13]].reshape(-1), atol=2e-3)  # from the frame
    assert not state_row[10:].any()

    cut = lv.pack_sample(decoded, dataclasses.replace(SAMPLE, seq_len=40)).astype(np.float32)
    assert lv.used_length(cut) == 40 and (cut == packed[:40]).all()


def test_a_step_splits_samples_over_dp_and_sequences_over_cp(dataset):
    refs = lv.sample_refs(dataset, SAMPLE, seed=1)[:4]
    slices = lv.preprocess_step(dataset, refs, SAMPLE, dp=2, cp=2)
    assert [s["tokens"].shape for s in slices] == [(2, 64, 196)] * 4
    for d in range(2):
        whole = np.concatenate([slices[d * 2]["tokens"], slices[d * 2 + 1]["tokens"]], axis=1)
        for i, ref in enumerate(refs[2 * d : 2 * d + 2]):
            packed = lv.preprocess_sample(dataset, ref, SAMPLE)
            assert whole[i].tobytes() == packed.tobytes()
            assert slices[d * 2]["lengths"][i] == slices[d * 2 + 1]["lengths"][i] == lv.used_length(packed)
    with pytest.raises(ValueError, match="does not split over dp=3"):
        lv.preprocess_step(dataset, refs, SAMPLE, dp=3, cp=1)

    report = lv.expansion(dataset, refs, SAMPLE)
    raw = sum(lv.decode_sample(dataset, ref, SAMPLE).raw_bytes for ref in refs)
    assert report["raw_bytes"] == raw and report["ready_bytes"] == 4 * 128 * 196 * 2
    assert report["expansion"] == report["ready_bytes"] / raw > 1
    one = lv.expansion(dataset, refs[:1], SAMPLE)
    assert one["raw_bytes"] < one["episode_bytes"]  # a sample reads a part of its episode's files


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_example_pool_publishes_steps_equal_to_preprocess_step(tmp_path):
    run("generate", "--data", str(tmp_path), "--episodes", "3", "--cameras", "2", "--height", "48", "--width", "64",
        "--fps", "10", "--seconds", "3", "--gop", "5")  # fmt: skip
    sample = ("--min-frames", "2", "--max-frames", "3", "--image-size", "32", "--patch", "8", "--text-tokens", "12")
    sample += ("--seq-len", "128", "--batch", "2", "--seed", "3")
    out = run("produce", "--data", str(tmp_path), "--producers", "2", "--dp", "2", "--cp", "2", *sample)
    root = tmp_path / "dataset"
    batches = lv.global_batches(lv.sample_refs(root, SAMPLE, seed=3), 2)
    assert f"committed {len(batches)} TGBs from {len(batches)} batches" in out and len(batches) >= 3
    url = str(tmp_path / "namespace")
    ranks = []
    for rank in range(4):
        with bw.Consumer(url, dp=2, cp=2, rank=rank, timeout_s=30) as consumer:
            ranks.append([batch.data for batch in consumer])
    published = sorted(tuple(r[step]["tokens"].tobytes() for r in ranks) for step in range(len(batches)))
    expected = [lv.preprocess_step(root, refs, SAMPLE, dp=2, cp=2) for refs in batches]
    # Producers interleave their steps; each step is one whole batch, byte for byte.
    assert published == sorted(tuple(s["tokens"].tobytes() for s in step) for step in expected)
    assert bw.inspect_namespace(url).layout == {"dp": 2, "cp": 2, "kind": "arrays"}
