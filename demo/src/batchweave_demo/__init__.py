"""``batchweave demo``: the whole story, with real processes, real SIGKILLs and checks.

One run, about a minute on a local directory (``store="s3"``: the same on a SeaweedFS
server the demo starts on loopback), shows every promise of the design at work:

1. ``producers`` preprocessing processes (``prep-0``, ``prep-1``, ...; ``spawn`` context)
   turn synthetic "raw images" into TGBs of ``dp * cp`` slices: decode, resize to 32x32,
   normalize, tokenize, pack. They commit explicitly (``commit_policy="manual"``,
   ``background_commit=False``, ``flush()`` every ``COMMIT_EVERY`` TGBs).
2. One producer is SIGKILLed while TGBs it uploaded are not committed. Nothing is left to
   timing: it uploads a group of TGBs, tells the parent over a pipe, and blocks before its
   ``flush()``. The parent lists those objects (in the store, named by no log version),
   kills it and starts it again under the same ``producer_id``: the new incarnation
   claims a higher epoch and resumes at the first uncommitted offset, and a GC dry run
   now calls the dead incarnation's objects orphans.
3. Every rank checkpoints its cursor (``state_dict()`` to a JSON file, then
   ``mark_checkpoint``) every ``checkpoint_every`` steps. One rank blocks a few steps
   after a checkpoint (the same pipe gate) and is SIGKILLed; a new process loads that
   checkpoint and reads the remaining steps. A "twin" process reads the same rank's
   slice uninterrupted, so the resumed stream can be compared byte for byte.
4. Once both kills are over and two checkpoints are complete, the parent releases the
   older ones (``release_checkpoint``) and collects garbage with a grace of 0 s
   (``collect_garbage``, as ``batchweave gc URL --grace-s 0``): storage behind the
   oldest live checkpoint and the killed producer's orphans go.
5. After the end of stream, the oldest live checkpoint's cursor resumes on a mesh with
   twice the DP size and on DP size 1: each reads every remaining slice exactly once.
6. Checks on what the processes actually received (dense step order, the same TGB on
   every rank of a step, exactly-once offsets, the resumes, bit-identical regeneration).
7. ``demo.png``: steps committed and consumed over time, kills and GC marked
   (matplotlib, ``pip install 'batchweave[demo]'``; skipped with a note when missing).

The package, one concern a module, in the order a run uses them:

- ``plan``: the run's shape and where every event happens (``plan_demo``);
- ``directory``: the demo directory, made fresh, never a foreign one;
- ``workload``: the synthetic images and their preprocessing into slices;
- ``workers``: the producer and rank processes (what runs in each child);
- ``processes``: the parent's side of them: starting, pipes, SIGKILLs;
- ``story``: the events, recorded and printed as they happen;
- ``orchestrator``: the event loop: kills, restarts, checkpoints, GC, the timeline;
- ``resumes``: after the stream, the released and the oldest live checkpoint resumed;
- ``checks`` and ``summary``: the checks on what the processes received, and the summary;
- ``figure`` and ``render``: ``demo.png``, the live display and the summary table;
- ``run``: ``run_demo``, which ties them together.

``run_demo()`` returns the summary: every event that happened (``events``, each with its
``kind``) and every check (``checks``). ``batchweave demo`` is a thin wrapper.
docs/demo.md explains how to read the output and the figure.
"""

from __future__ import annotations

from batchweave_demo.directory import default_demo_dir, prepare_demo_dir
from batchweave_demo.plan import DEFAULT_STEPS, DemoPlan, plan_demo
from batchweave_demo.render import render_summary
from batchweave_demo.run import run_demo
from batchweave_demo.workload import build_slice, build_tgb, slice_checksum

__all__ = [
    "DEFAULT_STEPS",
    "DemoPlan",
    "build_slice",
    "build_tgb",
    "default_demo_dir",
    "plan_demo",
    "prepare_demo_dir",
    "render_summary",
    "run_demo",
    "slice_checksum",
]
