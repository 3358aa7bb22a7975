"""The PyTorch dataset: tensors, DCP round trips, DeviceMesh mapping, DataLoader workers."""

from __future__ import annotations

import pickle
import time
import uuid

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from worker import Eager, tgb  # noqa: E402

import batchweave as bw  # noqa: E402
from batchweave.torch import TGBDataset, mesh_from_device_mesh  # noqa: E402


@pytest.fixture
def url():
    return f"memory://torch-{uuid.uuid4().hex}"


def produce(url, count, dp=2, cp=1, end=True):
    with bw.Producer(url, "p", dp=dp, cp=cp, commit_policy=Eager()) as producer:
        for offset in range(count):
            producer.append(tgb("p", offset, dp * cp), source_offset=offset)
    if end:
        bw.end_stream(url)


def plain(url, rank, dp=2):
    with bw.Consumer(url, dp=dp, rank=rank, timeout_s=20) as consumer:
        return [b.data for b in consumer]


def same(tensors, arrays):
    assert set(tensors) == set(arrays)
    for name, array in arrays.items():
        assert tensors[name].dtype == torch.from_numpy(np.array(array)).dtype
        assert np.array_equal(tensors[name].numpy(), array), name


def test_yields_zero_copy_tensors_equal_to_the_consumer(url, recwarn):
    produce(url, 5)
    ds = TGBDataset(url, dp=2, rank=1, timeout_s=20)
    assert isinstance(ds, Stateful)
    expected = plain(url, 1)
    got = []
    for step, batch in enumerate(DataLoader(ds, batch_size=None)):
        assert ds.last_step == step
        got.append(batch)
    assert len(got) == len(expected) == 5
    for tensors, arrays in zip(got, expected, strict=True):
        same(tensors, arrays)
    # The no-copy path wraps the consumer's read-only buffer itself, without a warning.
    ds2 = TGBDataset(url, dp=2, rank=1, timeout_s=20)
    consumer = ds2._get_consumer()
    batch = next(consumer)
    tensors = ds2._tensors(batch.data)
    for name, array in batch.data.items():
        assert not array.flags.writeable
        assert tensors[name].data_ptr() == array.__array_interface__["data"][0]
    assert not [w for w in recwarn if "not writable" in str(w.message)]
    copied = TGBDataset(url, dp=2, rank=1, copy=True)._tensors(batch.data)
    for name, array in batch.data.items():
        assert copied[name].data_ptr() != array.__array_interface__["data"][0]
        assert np.array_equal(copied[name].numpy(), array)
    ds2.close()


def test_bytes_payloads_pass_through(url):
    with bw.Producer(url, "p", dp=1, commit_policy=Eager()) as producer:
        producer.append([b"hello"])
        producer.append([b"world"])
    bw.end_stream(url)
    assert list(TGBDataset(url, dp=1, timeout_s=20)) == [b"hello", b"world"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_round_trip_resumes_byte_for_byte(url, tmp_path):
    produce(url, 8)
    expected = plain(url, 0)
    ds = TGBDataset(url, dp=2, rank=0, timeout_s=20)
    it = iter(ds)
    head = [next(it) for _ in range(3)]
    dcp.save({"data": ds}, checkpoint_id=str(tmp_path / "ckpt"))
    ds.close()
    assert ds.state_dict()["step"] == 3 and ds.state_dict()["position_numerator"] == 3
    ds2 = TGBDataset(url, dp=2, rank=0, timeout_s=20)
    dcp.load({"data": ds2}, checkpoint_id=str(tmp_path / "ckpt"))
    assert ds2.state_dict() == ds.state_dict()
    rest = list(ds2)
    assert len(head) + len(rest) == len(expected)
    for tensors, arrays in zip(head + rest, expected, strict=True):
        same(tensors, arrays)
    assert ds2.last_step == 7


def test_a_stateful_data_loader_resumes_exactly_from_its_state_and_through_dcp(url, tmp_path):
    """torchdata's StatefulDataLoader keeps the dataset's cursor under "dataset_state" and
    hands a loaded one to the dataset at iter(): from then on, before any read,
    ``dataset.state_dict()`` is the loaded cursor (the step to continue at)."""
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    loader_of = lambda dataset: stateful_dataloader.StatefulDataLoader(dataset, batch_size=None)  # noqa: E731
    produce(url, 8)
    expected = plain(url, 1)
    loader = loader_of(TGBDataset(url, dp=2, rank=1, timeout_s=20))
    batches = iter(loader)
    head = [next(batches) for _ in range(3)]
    saved = loader.state_dict()
    assert saved["dataset_state"] == loader.dataset.state_dict() and saved["dataset_state"]["step"] == 3
    dcp.save({"loader": loader}, checkpoint_id=str(tmp_path / "ckpt"))

    again = loader_of(TGBDataset(url, dp=2, rank=1, timeout_s=20))
    again.load_state_dict(saved)
    resumed = list(again)

    dataset = TGBDataset(url, dp=2, rank=1, timeout_s=20)
    restored = loader_of(dataset)
    dcp.load({"loader": restored}, checkpoint_id=str(tmp_path / "ckpt"))
    assert restored.state_dict()["dataset_state"] == saved["dataset_state"]  # held by the loader until iter()
    batches = iter(restored)
    assert dataset.state_dict() == saved["dataset_state"] and dataset.last_step is None  # handed over, nothing read
    through_dcp = list(batches)
    for rest in (resumed, through_dcp):
        assert len(head) + len(rest) == len(expected)
        for tensors, arrays in zip(head + rest, expected, strict=True):
            same(tensors, arrays)
    assert dataset.last_step == 7
    with pytest.raises(bw.ConfigError, match="batches"):  # its default batch_size=1, as with a DataLoader
        next(iter(stateful_dataloader.StatefulDataLoader(TGBDataset(url, dp=2, rank=1, timeout_s=20))))
    for each in (loader.dataset, again.dataset, dataset):
        each.close()


def test_state_loaded_on_another_mesh_names_that_mesh_step_before_iterating(url):
    produce(url, 8)
    ds = TGBDataset(url, dp=2, rank=0, timeout_s=20)
    it = iter(ds)
    head = [next(it) for _ in range(3)]
    saved = ds.state_dict()
    ds.close()
    one_rank = TGBDataset(url, dp=1, rank=0, timeout_s=20)
    one_rank.load_state_dict(saved)  # DP shrinks 2-fold: TGB 3 is steps 6 and 7
    assert (one_rank.state_dict()["step"], one_rank.state_dict()["dp"]) == (6, 1)
    first = next(iter(one_rank))
    assert one_rank.last_step == 6 and len(head) == 3
    expected = plain(url, 0)[3]  # rank 0's half of TGB 3 at dp=2 is slice 0, what step 6 reads
    same(first, expected)
    one_rank.close()


def test_state_loads_before_and_during_iteration_and_is_validated(url):
    produce(url, 6)
    ds = TGBDataset(url, dp=2, rank=0, timeout_s=20)
    assert ds.state_dict() == {
        "format": "batchweave.cursor/2",
        "version": 0,
        "position_numerator": 0,
        "position_denominator": 1,
        "step": 0,
        "dp": 2,
        "cp": 1,
        "namespace": "",  # not known before the log is read
    }
    it = iter(ds)
    next(it), next(it)
    saved = ds.state_dict()
    assert saved["namespace"] == bw.inspect_namespace(url).namespace
    next(it)
    ds.load_state_dict(saved)  # rewinds a running dataset
    assert [ds.last_step for _ in iter(ds)] == [2, 3, 4, 5]
    with pytest.raises(bw.ConfigError, match="lacks"):
        ds.load_state_dict({"format": "batchweave.cursor/1"})
    with pytest.raises(bw.ConfigError, match="not a BatchWeave"):
        ds.load_state_dict({**saved, "format": "other"})
    with pytest.raises(bw.ConfigError, match="denominator"):
        ds.load_state_dict({**saved, "position_denominator": 0})
    ds.close()


def test_num_workers_refused_and_dataset_pickles_before_iteration(url):
    ds = TGBDataset(url, dp=2, rank=0, timeout_s=5)
    clone = pickle.loads(pickle.dumps(ds))
    assert (clone.mesh, clone.rank, clone.state_dict()) == (ds.mesh, ds.rank, ds.state_dict())
    with pytest.raises(bw.ConfigError, match="num_workers=0"):
        next(iter(DataLoader(ds, batch_size=None, num_workers=1)))


class FakeMesh:
    def __init__(self, names, shape, coordinate):
        self.mesh_dim_names, self.shape, self._coordinate = names, shape, coordinate

    def get_coordinate(self):
        return self._coordinate

    def get_rank(self):
        raise AssertionError("the coordinate decides the rank")


def test_device_mesh_mapping():
    # Dims in any order; the rank follows BatchWeave's pp, dp, cp, tp order.
    mesh, rank = mesh_from_device_mesh(FakeMesh(("tp", "dp"), (2, 4), (1, 3)))
    assert (mesh, rank) == (bw.Mesh(dp=4, tp=2), 3 * 2 + 1)
    mesh, rank = mesh_from_device_mesh(
        FakeMesh(("pipe", "data", "model"), (2, 2, 2), (1, 0, 1)), {"pp": "pipe", "dp": "data", "tp": "model"}
    )
    assert (mesh, rank) == (bw.Mesh(dp=2, tp=2, pp=2), 5)
    ds = TGBDataset("memory://unused", mesh=FakeMesh(("dp", "cp"), (2, 2), (1, 1)))
    assert (ds.mesh, ds.rank) == (bw.Mesh(dp=2, cp=2), 3)
    assert TGBDataset("memory://unused", mesh=FakeMesh(("dp",), (2,), (1,)), rank=0).rank == 0
    with pytest.raises(bw.ConfigError, match="no role"):
        mesh_from_device_mesh(FakeMesh(("dp", "ep"), (2, 2), (0, 0)))
    with pytest.raises(bw.ConfigError, match="not a mesh dim"):
        mesh_from_device_mesh(FakeMesh(("data",), (2,), (0,)), {"dp": "batch"})
    with pytest.raises(bw.ConfigError, match="mesh_dim_names"):
        mesh_from_device_mesh(FakeMesh(None, (2,), (0,)))
    with pytest.raises(bw.ConfigError, match="not both"):
        TGBDataset("memory://unused", mesh=FakeMesh(("dp",), (2,), (0,)), dp=2)


def test_real_device_mesh_of_one_process(url, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    produce(url, 2, dp=1)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg"), 1), rank=0, world_size=1)
    try:
        device_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data", "tp"))
        ds = TGBDataset(url, mesh=device_mesh, dim_names={"dp": "data", "tp": "tp"}, timeout_s=20)
        assert (ds.mesh, ds.rank) == (bw.Mesh(dp=1), 0)
        assert len(list(ds)) == 2
        dcp.save({"data": ds}, checkpoint_id=str(tmp_path / "ckpt"))
        ds2 = TGBDataset(url, mesh=device_mesh, dim_names={"dp": "data", "tp": "tp"}, timeout_s=20)
        dcp.load({"data": ds2}, checkpoint_id=str(tmp_path / "ckpt"))
        assert ds2.state_dict()["step"] == 2
    finally:
        dist.destroy_process_group()


# -- issue 12: a DataLoader that batches, readers that would create, one cursor format -------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_data_loader_that_batches_is_refused(url, num_workers):
    """``DataLoader(dataset)`` batches by default (batch_size=1): it would add a leading
    dimension of 1 to every tensor. Refused at iter(), with the fix."""
    produce(url, 2)
    ds = TGBDataset(url, dp=2, rank=0, timeout_s=20)
    for loader in (DataLoader(ds, num_workers=num_workers), DataLoader(ds, batch_size=4, num_workers=num_workers)):
        started = time.monotonic()
        with pytest.raises(bw.ConfigError, match="batches") as info:
            next(iter(loader))
        assert time.monotonic() - started < 30  # (worker processes take a few seconds to start)
        fix = "DataLoader(dataset, batch_size=None, num_workers=0)" if num_workers else "batch_size=None)"
        assert fix in str(info.value)
    batch = next(iter(DataLoader(ds, batch_size=None)))  # the right call still works, unbatched
    same(batch, plain(url, 0)[0])
    ds.close()


def test_the_dataset_refuses_a_missing_directory_and_unknown_options_when_made(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(bw.ConfigError, match=f"no namespace at file://{missing}"):
        TGBDataset(str(missing), dp=1)
    assert not missing.exists()
    with pytest.raises(bw.ConfigError, match="mistyped namespace URL 's3//bucket/run'"):
        TGBDataset("s3//bucket/run", dp=1)
    with pytest.raises(bw.ConfigError, match="unknown storage option 'regoin'"):
        TGBDataset("s3://bucket/run", dp=1, storage_options={"regoin": "x"})
    with pytest.raises(TypeError, match="max_lags"):
        TGBDataset("memory://x", dp=1, max_lags=3)


def test_consumer_and_dataset_share_one_cursor(url):
    produce(url, 6)
    consumer = bw.Consumer(url, dp=2, rank=0, timeout_s=20)
    next(consumer), next(consumer)
    saved = consumer.state_dict()
    consumer.close()
    assert saved["format"] == "batchweave.cursor/2"
    assert all(type(v) in (int, str) for v in saved.values()), saved  # DCP-friendly: ints and strings
    ds = TGBDataset(url, dp=2, rank=0, timeout_s=20)
    ds.load_state_dict(saved)
    assert ds.state_dict() == saved
    it = iter(ds)
    next(it)
    assert ds.last_step == 2
    resumed = bw.Consumer(url, dp=2, rank=0, timeout_s=20)
    resumed.load_state_dict(ds.state_dict())  # and back
    assert resumed.state_dict() == ds.state_dict() and next(resumed).step == 3
    resumed.close()
    ds.close()


def test_cursors_saved_in_the_first_format_still_load(url):
    """batchweave.cursor/1 had two shapes: the consumer's position list, the dataset's flat keys."""
    produce(url, 6)
    with bw.Consumer(url, dp=2, rank=0, timeout_s=20) as consumer:
        next(consumer), next(consumer), next(consumer)
        now = consumer.state_dict()
    common = {k: now[k] for k in ("version", "step", "dp", "cp", "namespace")}
    consumer_v1 = {"format": "batchweave.cursor/1", **common, "position": [3, 1]}
    dataset_v1 = {"format": "batchweave.cursor/1", **common, "position_numerator": 3, "position_denominator": 1}
    for old in (consumer_v1, dataset_v1):
        ds = TGBDataset(url, dp=2, rank=0, timeout_s=20)
        ds.load_state_dict(old)
        assert ds.state_dict() == now
        assert [ds.last_step for _ in iter(ds)] == [3, 4, 5]
        with bw.Consumer(url, dp=2, rank=0, timeout_s=20) as consumer:
            consumer.load_state_dict(old)
            assert [b.step for b in consumer] == [3, 4, 5]
    with pytest.raises(bw.ConfigError, match=r"position \[numerator, denominator\]"):
        TGBDataset(url, dp=2, rank=0).load_state_dict({**consumer_v1, "position": 3})
    with pytest.raises(bw.ConfigError, match="lacks"):
        TGBDataset(url, dp=2, rank=0).load_state_dict({k: v for k, v in now.items() if k != "dp"})


def test_dcp_saves_the_consumer_and_loads_it_into_the_dataset(url, tmp_path):
    produce(url, 6)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg"), 1), rank=0, world_size=1)
    try:
        consumer = bw.Consumer(url, dp=2, rank=0, timeout_s=20)
        next(consumer), next(consumer)
        dcp.save({"data": consumer}, checkpoint_id=str(tmp_path / "ckpt"))
        consumer.close()
        ds = TGBDataset(url, dp=2, rank=0, timeout_s=20)
        dcp.load({"data": ds}, checkpoint_id=str(tmp_path / "ckpt"))
        assert ds.state_dict() == consumer.state_dict()
        assert [ds.last_step for _ in iter(ds)] == [2, 3, 4, 5]

        class DatasetV1:  # what TGBDataset.state_dict() gave before cursor/2: a DCP checkpoint of it loads
            def state_dict(self):
                saved = consumer.state_dict()
                return {**saved, "format": "batchweave.cursor/1"}

            def load_state_dict(self, state):
                raise AssertionError("only saved")

        dcp.save({"data": DatasetV1()}, checkpoint_id=str(tmp_path / "ckpt-v1"))
        old = TGBDataset(url, dp=2, rank=0, timeout_s=20)
        dcp.load({"data": old}, checkpoint_id=str(tmp_path / "ckpt-v1"))
        assert old.state_dict() == consumer.state_dict()
    finally:
        dist.destroy_process_group()
