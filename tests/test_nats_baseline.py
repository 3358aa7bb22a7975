"""The NATS JetStream strict-TGB baseline against a real local nats-server."""

from __future__ import annotations

import pytest

from benchmarks.nats_baseline import find_nats_server, measure_nats, nats_server, process_cpu_s

MIB = 1024 * 1024


@pytest.fixture(autouse=True)
def _need_nats_server():
    if find_nats_server() is None:
        pytest.fail("nats-server is not installed: run `make test` (or `apt-get install nats-server`)")
    try:
        import nats  # noqa: F401
    except ImportError:
        pytest.fail("nats-py is not installed: run `make test` (or `.venv/bin/pip install nats-py`)")


def test_small_tgbs_commit(tmp_path):
    r = measure_nats(producers=2, payload_bytes=10_000, duration_s=1.0, workdir=tmp_path)
    assert r["system"] == "nats" and r["policy"] == "strict-tgb"
    assert r["producers"] == 2 and r["payload_bytes"] == 10_000 and r["duration_s"] == 1.0
    assert r["tgbs_committed"] > 0
    assert r["tgbs_failed"] == 0 and r["commit_success_rate"] == 1.0 and r["error"] is None
    assert r["throughput_mb_s"] == pytest.approx(r["tgbs_committed"] * 10_000 / 1.0 / 1e6)
    assert 0 < r["throughput_mb_s"] < 10_000
    assert r["max_payload_bytes"] == MIB
    assert not (tmp_path / "js").exists()  # JetStream data deleted
    # the window's CPU: the server's process and this one, where the publishers run
    assert r["server_cpu_s"] > 0 and r["client_cpu_s"] > 0


# A child that spends CPU, reports its own count (process_time: the whole process's,
# start-up included), then waits for its stdin to close.
BURN = (
    "import sys, time\n"
    "while time.process_time() < 0.3: pass\n"
    "print(time.process_time(), flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_processs_cpu_is_read_from_proc_as_it_counts_it_itself():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdin is not None
    try:
        own = float(child.stdout.readline())
        assert process_cpu_s(child.pid) == pytest.approx(own, abs=0.05)  # clock ticks of 10 ms, and the print
    finally:
        child.stdin.close()
        child.wait(timeout=10)
    assert process_cpu_s(child.pid) is None  # gone: no figure, not an error


def test_tgb_over_default_limit_fails_every_publish(tmp_path):
    r = measure_nats(producers=2, payload_bytes=2 * MIB, duration_s=0.5, workdir=tmp_path)
    assert r["tgbs_committed"] == 0 and r["tgbs_failed"] > 0
    assert r["throughput_mb_s"] == 0 and r["commit_success_rate"] == 0
    assert "payload" in r["error"].lower()
    assert r["max_payload_bytes"] == MIB


def test_raised_limit_accepts_large_tgb(tmp_path):
    r = measure_nats(producers=2, payload_bytes=2 * MIB, duration_s=1.0, workdir=tmp_path, max_payload_bytes=8 * MIB)
    assert r["max_payload_bytes"] == 8 * MIB
    assert r["tgbs_committed"] > 0 and r["tgbs_failed"] == 0
    assert r["commit_success_rate"] == 1.0 and r["error"] is None and r["throughput_mb_s"] > 0


def test_limit_is_clamped_to_64_mib(tmp_path):
    import asyncio

    import nats

    async def announced(url):
        nc = await nats.connect(url)
        try:
            return nc.max_payload
        finally:
            await nc.close()

    with nats_server(tmp_path, max_payload_bytes=1024 * MIB) as url:
        assert url.startswith("nats://127.0.0.1:")
        assert asyncio.run(announced(url)) == 64 * MIB


def test_missing_binary_is_a_config_error(tmp_path, monkeypatch):
    from batchweave.errors import ConfigError
    from benchmarks import nats_baseline

    monkeypatch.setattr(nats_baseline, "find_nats_server", lambda: None)
    with pytest.raises(ConfigError, match="apt-get install nats-server"):
        with nats_baseline.nats_server(tmp_path):
            pass
