"""What the request-rate limiter costs a store request while the store never throttles:
``python -m benchmarks.rate_limit_overhead [--rounds N] [--calls N]``.

Times, on a memory store, ``Store._call`` of a request that does nothing (the retry and
limiter wrapper alone) and ``Store.get`` of a 1 KB object (a real obstore request), for
``Store`` as it is and for ``Before``: the same class with ``_call`` and ``_attempt`` as
they were before the limiter (compiled in the namespace of ``batchweave.store.requests``,
where they are now, so globals cost the same). The two take turns in short rounds, so a
change in the machine's load hits both alike. Prints the fastest and the median round, in nanoseconds per call, as a
Markdown table. Not one of ``batchweave bench``'s benchmarks: a micro-benchmark of one code path.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable

from batchweave.store import Store
from batchweave.store import requests as requests_module

# Store._call and Store._attempt before the limiter (commit 6349aa0), verbatim but for the names
# (the class's, and _never_reached, now store.failures.never_reached).
_BEFORE = """
class Before(Store):
    def _call(self, key, op, request, nbytes=0, *, conditional=False):
        self._refuse_forked_runtime()
        try:
            return self._attempt_before(key, op, request, nbytes, conditional)
        except TransientStoreError as error:
            failed = error
        return self._retry(key, op, request, nbytes, conditional, failed, None)

    def _attempt_before(self, key, op, request, nbytes, conditional):
        global _runtime_pid
        try:
            result = self._perform(request, nbytes, op)
        except BatchWeaveError:
            raise
        except Exception as exc:
            self._reached = self._reached or not never_reached(exc)
            raise translate_error(exc, key, conditional=conditional, request=request, store=self.url) from exc
        finally:
            _runtime_pid = os.getpid()
        self._reached = True
        return result
"""


def _before_class() -> type[Store]:
    # A copy of the request path's module (the old code's global writes land there) and Store.
    namespace = {**vars(requests_module), "Store": Store}
    exec(_BEFORE, namespace)  # our own source text, above
    return namespace["Before"]


def _calls(store: Store) -> dict[str, Callable[[], object]]:
    return {
        "Store._call (empty request)": lambda: store._call("k", lambda: None, "get"),
        "Store.get (1 KB, memory store)": lambda: store.get("k"),
    }


def measure(rounds: int, calls: int) -> dict[tuple[str, str], list[float]]:
    """Nanoseconds per call of each round, per (call, version)."""
    url = f"memory://overhead-{uuid.uuid4().hex}"
    versions = {"before": _before_class()(url), "with the limiter": Store(url)}
    versions["before"].put_if_absent("k", b"x" * 1000)
    samples: dict[tuple[str, str], list[float]] = {}
    for index in range(rounds):
        for version, store in sorted(versions.items(), reverse=bool(index % 2)):  # each goes first in turn
            for name, call in _calls(store).items():
                n = calls if "_call" in name else calls // 4
                started = time.perf_counter()
                for _ in range(n):
                    call()
                samples.setdefault((name, version), []).append((time.perf_counter() - started) / n * 1e9)
    return samples


def table(samples: dict[tuple[str, str], list[float]]) -> str:
    lines = [
        "| call | statistic | before ns | with limiter ns | difference ns | ratio |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name in dict.fromkeys(name for name, _ in samples):
        for statistic in (min, statistics.median):
            before = statistic(samples[(name, "before")])
            after = statistic(samples[(name, "with the limiter")])
            lines.append(
                f"| {name} | {statistic.__name__} of rounds | {before:.0f} | {after:.0f} | {after - before:+.0f} "
                f"| {after / before:.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=101)
    parser.add_argument("--calls", type=int, default=5_000)
    args = parser.parse_args()
    measure(1, args.calls // 10)  # warm up
    print(table(measure(args.rounds, args.calls)))


if __name__ == "__main__":
    main()
