"""The PyTorch dataset: tensors, DCP round trips, DeviceMesh mapping, DataLoader workers."""

from __future__ import annotations

import pickle
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
        "format": "batchweave.cursor/1",
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
