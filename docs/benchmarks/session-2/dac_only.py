"""DAC alone, as in `bench dac` full mode (32 producers, 100 KB, 180 s, latency model)."""
import json
from batchweave.bench.ingest import IngestSpec, bench_store, run_ingest
from batchweave.bench.report import BenchOptions
if __name__ == "__main__":
    with bench_store(BenchOptions(), "dac-only") as store:
        record, _ = run_ingest(IngestSpec("dac", 32, 100_000, 180.0), store)
    print(json.dumps(record, indent=1))
