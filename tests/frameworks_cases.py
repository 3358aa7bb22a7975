"""PyTorch, JAX (Grain) and TensorFlow (tf.data) readers of one namespace: the same bytes at
every step for the same rank, checkpoints that resume exactly, and one cursor format.

Run by ``test_frameworks.py`` in a fresh interpreter (it says why); run directly with
``pytest tests/frameworks_cases.py``."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
grain = pytest.importorskip("grain")
jax = pytest.importorskip("jax")
tf = pytest.importorskip("tensorflow")

from etils import epath  # noqa: E402  (a dependency of grain)
from worker import Eager, tgb  # noqa: E402

import batchweave as bw  # noqa: E402
from batchweave.errors import ConfigError, LayoutError  # noqa: E402
from batchweave.grain import TGBIterDataset  # noqa: E402
from batchweave.lifecycle.watermarks import read_watermarks  # noqa: E402
from batchweave.store import open_store  # noqa: E402
from batchweave.tf import TGBReader  # noqa: E402
from batchweave.torch import TGBDataset  # noqa: E402

STEPS = 8
MESH = {"dp": 2, "tp": 2}  # 4 ranks; TP ranks of one data-parallel index read the same slice
RANKS = range(4)
CUT = 3  # the step after which each reader saves its state


def digest(batch) -> str:
    """Names, dtypes, shapes and bytes of one step, whichever framework's arrays hold it."""
    h = hashlib.sha256()
    for name in sorted(batch):
        array = np.asarray(batch[name].numpy() if hasattr(batch[name], "numpy") else batch[name])
        h.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def namespace(tmp_path_factory):
    """A local directory namespace with STEPS steps committed by a producer, and each
    rank's step digests as a plain Consumer reads them."""
    url = f"file://{tmp_path_factory.mktemp('frameworks')}"
    with bw.Producer(url, "p", dp=MESH["dp"], commit_policy=Eager()) as producer:
        for offset in range(STEPS):
            producer.append(tgb("p", offset, MESH["dp"]), source_offset=offset)
    bw.end_stream(url)
    expected = {}
    for rank in RANKS:
        with bw.Consumer(url, **MESH, rank=rank) as consumer:
            expected[rank] = [digest(batch.data) for batch in consumer]
    assert len({tuple(v) for v in expected.values()}) == MESH["dp"]  # two distinct slices, TP ranks agree
    return url, expected


def watermark_position(url, checkpoint_id):
    (checkpoint,) = [c for c in read_watermarks(open_store(url)) if c.checkpoint == checkpoint_id]
    return checkpoint.position


def torch_run(url, rank, state=None):
    """Digests read by a fresh TGBDataset (from ``state``), and its state after CUT steps."""
    ds = TGBDataset(url, **MESH, rank=rank)
    if state is not None:
        ds.load_state_dict(state)
    digests, saved = [], None
    for batch in torch.utils.data.DataLoader(ds, batch_size=None):
        digests.append(digest(batch))
        if len(digests) == CUT:
            saved = ds.state_dict()
    ds.close()
    return digests, saved


def grain_run(url, rank, checkpoint_dir=None, restore_dir=None):
    """Digests read by a fresh Grain iterator; its state saved by Grain's checkpoint handler."""
    iterator = iter(TGBIterDataset(url, **MESH, rank=rank))
    handler = grain.checkpoint.CheckpointHandler()
    if restore_dir is not None:
        handler.restore(epath.Path(restore_dir), item=iterator)
    digests = []
    for batch in iterator:
        digests.append(digest(batch))
        if len(digests) == CUT and checkpoint_dir is not None:
            handler.save(epath.Path(checkpoint_dir), item=iterator)
    iterator.close()
    return digests


def tf_run(url, rank, save_prefix=None, restore_path=None):
    """Digests read by a fresh TGBReader; its cursor saved with tf.train.Checkpoint."""
    reader = TGBReader(url, **MESH, rank=rank)
    checkpoint = tf.train.Checkpoint(data=reader)
    if restore_path is not None:
        checkpoint.restore(restore_path).assert_consumed()
    digests, saved = [], None
    for batch in reader:
        digests.append(digest(batch))
        if len(digests) == CUT and save_prefix is not None:
            saved = checkpoint.save(save_prefix)
    return digests, saved


@pytest.mark.parametrize("rank", RANKS)
def test_every_framework_reads_the_same_bytes_and_resumes_exactly(namespace, rank, tmp_path):
    url, expected = namespace
    want = expected[rank]

    got, torch_state = torch_run(url, rank)
    assert got == want
    assert torch_run(url, rank, state=torch_state)[0] == want[CUT:]

    (tmp_path / "grain").mkdir()  # Orbax makes the directory it hands to Grain's handler
    assert grain_run(url, rank, checkpoint_dir=tmp_path / "grain") == want
    saved = json.loads(next((tmp_path / "grain").glob("process_*.json")).read_text())
    assert saved == torch_state  # Grain stored the cursor itself, as JSON
    assert grain_run(url, rank, restore_dir=tmp_path / "grain") == want[CUT:]

    got, path = tf_run(url, rank, save_prefix=str(tmp_path / "tf" / "ckpt"))
    assert got == want
    assert tf_run(url, rank, restore_path=path)[0] == want[CUT:]


def test_a_state_saved_by_one_framework_resumes_in_every_other(namespace):
    url, expected = namespace
    rank = 2
    want = expected[rank][CUT:]
    _, torch_state = torch_run(url, rank)

    iterator = iter(TGBIterDataset(url, **MESH, rank=rank))
    iterator.set_state(json.loads(json.dumps(torch_state)))  # torch -> grain
    assert [digest(b) for b in iterator] == want
    grain_done = iterator.get_state()

    reader = TGBReader(url, **MESH, rank=rank)
    reader.deserialize(json.dumps(iterator.get_state()).encode())  # grain (at the end) -> tf
    assert list(reader) == []
    assert reader.state_dict() == grain_done

    reader.load_state_dict(torch_state)  # torch -> tf
    taken = []
    for batch in reader:
        taken.append(digest(batch))
        if len(taken) == 2:
            break
    dataset = TGBDataset(url, **MESH, rank=rank)
    dataset.load_state_dict(reader.state_dict())  # tf -> torch
    assert [digest(b) for b in torch.utils.data.DataLoader(dataset, batch_size=None)] == want[2:]
    assert taken == want[:2]


def test_tf_cursor_is_what_the_loop_consumed_not_what_tf_data_pulled(namespace, tmp_path):
    url, expected = namespace
    reader = TGBReader(url, **MESH, rank=1)
    pulled = []

    def count(batch, cursor):  # runs as tf.data pulls an element
        with tf.control_dependencies([tf.py_function(lambda: pulled.append(1) or 0, [], tf.int32)]):
            return batch, tf.identity(cursor)

    loop = reader.iterate(reader.dataset.map(count).prefetch(STEPS))
    first = [digest(next(loop)) for _ in range(2)]
    deadline = time.monotonic() + 20
    while len(pulled) < STEPS and time.monotonic() < deadline:  # tf.data reads ahead to the end
        time.sleep(0.01)
    assert len(pulled) == STEPS
    assert reader.state_dict()["step"] == 2 and reader.last_step == 1
    reader.mark_checkpoint("tf-consumed-2")  # the watermark is the consumed cursor too
    assert watermark_position(url, "tf-consumed-2") == 2
    path = tf.train.Checkpoint(data=reader).save(str(tmp_path / "ckpt"))

    resumed = TGBReader(url, **MESH, rank=1)
    tf.train.Checkpoint(data=resumed).restore(path)
    assert first + [digest(b) for b in resumed] == expected[1]
    # The same reader starts its next loop from what was consumed, not what was pulled.
    assert [digest(b) for b in reader] == expected[1][2:]


def test_tf_reader_raises_typed_errors(namespace, tmp_path):
    url, _ = namespace
    other = f"file://{tmp_path}"
    with bw.Producer(other, "p", dp=2, commit_policy=Eager()) as producer:
        producer.append(tgb("p", 0, 2), source_offset=0)
    bw.end_stream(other)
    reader = TGBReader(url, **MESH, rank=0)
    loop = iter(reader)
    next(loop)
    stranger = TGBReader(other, **MESH, rank=0)
    stranger.load_state_dict(reader.state_dict())
    with pytest.raises(ConfigError, match="saved from namespace"):
        next(iter(stranger))  # the consumer's own check, raised as itself through tf.data
    with pytest.raises(ConfigError, match="not JSON"):
        reader.deserialize(b"{torn")

    class Foreign(tf.train.experimental.PythonState):  # another object saved under the same name
        def serialize(self):
            return '{"format": "elsewhere/1"}'

        def deserialize(self, string_value):
            pass

    foreign = tf.train.Checkpoint(data=Foreign()).save(str(tmp_path / "foreign" / "ckpt"))
    with pytest.raises(ConfigError, match="not a BatchWeave consumer state"):
        tf.train.Checkpoint(data=reader).restore(foreign)
    with pytest.raises(ConfigError, match="not a BatchWeave consumer state"):
        reader.load_state_dict({"format": "elsewhere/1"})
    reader.load_state_dict(reader.state_dict())
    with pytest.raises(ConfigError, match="restored while this loop was running"):
        next(loop)  # the loop started before the restores above
    with pytest.raises(ConfigError, match="keep the cursor"):
        next(reader.iterate(reader.dataset.map(lambda batch, cursor: batch)))
    wrong = {"tokens": tf.TensorSpec([None, None], tf.float32)}
    with pytest.raises(LayoutError, match="element_spec has"):
        next(iter(TGBReader(url, **MESH, rank=0, element_spec=wrong)))


def test_grain_iterator_refuses_bad_states_and_splits(namespace, tmp_path):
    url, _ = namespace
    dataset = TGBIterDataset(url, **MESH, rank=0)
    iterator = iter(dataset)
    with pytest.raises(ConfigError, match="not a BatchWeave consumer state"):
        iterator.set_state({"format": "elsewhere/1"})
    other = f"file://{tmp_path}"
    with bw.Producer(other, "p", dp=2, commit_policy=Eager()) as producer:
        producer.append(tgb("p", 0, 2), source_offset=0)
    next(iterator)
    iterator.mark_checkpoint("grain-consumed-1")
    assert watermark_position(url, "grain-consumed-1") == 1
    stranger = iter(TGBIterDataset(other, **MESH, rank=0))
    stranger.set_state(iterator.get_state())
    with pytest.raises(ConfigError, match="saved from namespace"):
        stranger.start_prefetch()  # Grain's checkpoint handler calls it right after set_state
    with pytest.raises(ConfigError, match="saved from namespace"):
        next(stranger)
    dataset.set_slice(slice(0, None, 1))  # one worker: the whole stream, accepted
    with pytest.raises(ConfigError, match="cannot be split"):
        dataset.set_slice(slice(1, None, 2))
    # Without rank=, the rank is the JAX process index: one process there, so one rank.
    assert in_fresh_python(RANK_FROM_JAX.format(url=url)) == "ConfigError 0"
    assert callable(dataset.prefetch)  # Grain's own methods are not shadowed by the reader's settings
    iterator.close()


def test_raw_bytes_and_chained_transformations(tmp_path):
    url = f"file://{tmp_path}"
    with bw.Producer(url, "p", dp=1, commit_policy=Eager()) as producer:
        for offset, payload in enumerate((b"hello", b"world")):
            producer.append([payload], source_offset=offset)
    bw.end_stream(url)
    assert list(TGBIterDataset(url, dp=1)) == [b"hello", b"world"]
    reader = TGBReader(url, dp=1)
    assert [t.numpy() for t in reader] == [b"hello", b"world"]
    assert reader.element_spec == tf.TensorSpec((), tf.string)
    # A Grain chain keeps the cursor as its iterator's state.
    chained = iter(TGBIterDataset(url, dp=1).map(lambda data: data.upper()))
    assert next(chained) == b"HELLO"
    assert chained.get_state()["step"] == 1


# Code that starts JAX's backend runs in a fresh interpreter: once it has started, a fork
# in this pytest worker (later tests start producers with multiprocessing) may deadlock,
# as JAX warns.
RANK_FROM_JAX = """
from batchweave.errors import ConfigError
from batchweave.grain import TGBIterDataset
try:
    TGBIterDataset({url!r}, dp=2)
except ConfigError as error:
    assert "jax.process_count() = 1" in str(error), error
    print("ConfigError", TGBIterDataset({url!r}, dp=1).rank)
"""
TO_JAX = """
import numpy as np
from batchweave.errors import LayoutError
from batchweave.grain import to_jax
buffer = np.arange(1024 + 64, dtype=np.uint8)
start = -buffer.__array_interface__["data"][0] % 64
aligned = buffer[start : start + 1024].view(np.int32)
unaligned = buffer[start + 16 : start + 16 + 1024 - 64].view(np.int32)
for array in (aligned, unaligned):
    array.flags.writeable = False  # as the consumer yields them
out = to_jax({"aligned": aligned, "unaligned": unaligned})
assert out["aligned"].unsafe_buffer_pointer() == aligned.__array_interface__["data"][0]
assert out["unaligned"].unsafe_buffer_pointer() != unaligned.__array_interface__["data"][0]
for name, array in {"aligned": aligned, "unaligned": unaligned}.items():
    assert np.array_equal(np.asarray(out[name]), array)
try:
    to_jax(b"payload")
except LayoutError as error:
    assert "raw-bytes" in str(error), error
    print("shared aligned, copied unaligned, refused bytes")
"""


def in_fresh_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_to_jax_wraps_aligned_arrays_without_a_copy():
    assert in_fresh_python(TO_JAX) == "shared aligned, copied unaligned, refused bytes"


def test_the_core_package_imports_no_framework():
    frameworks = ("torch", "jax", "grain", "tensorflow")
    code = f"import sys, batchweave, batchweave.cli; print(sorted(m for m in {frameworks} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
