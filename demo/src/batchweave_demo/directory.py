"""The directory the demo owns: made fresh for every run, never one the demo did not
create, and the JSON files in it (written atomically: a SIGKILL never leaves half a file)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from batchweave.errors import ConfigError

MARKER = ".batchweave-demo"  # marks a directory the demo created and may wipe
_OWNED_CHILDREN = ("namespace", "results", "checkpoints", "summary.json", "timeline.json", "demo.png")
_KEEP_DEFAULT_RUNS = 3


def write_json(path: Path, value: Any) -> None:
    """Atomic replace, so a reader (or a SIGKILL) never leaves a half-written file."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def prepare_demo_dir(directory: str | os.PathLike[str]) -> Path:
    """Make ``directory`` a fresh demo directory; never touch one the demo did not create.

    A missing or empty directory is taken and marked; one that carries the demo's marker
    has its previous namespace and results removed (nothing else in it); anything else is
    refused with a ConfigError.
    """
    path = Path(directory).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"demo directory {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        if not (path / MARKER).is_file():
            raise ConfigError(
                f"demo directory {path} is not empty and was not created by the demo; "
                "give an empty or new directory (--dir)"
            )
        for name in _OWNED_CHILDREN:
            child = path / name
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            elif child.exists() or child.is_symlink():
                child.unlink()
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text(json.dumps({"created_by": "batchweave demo", "at": time.time()}) + "\n")
    return path


def default_demo_dir(root: str | os.PathLike[str] = "demo-data") -> Path:
    """``root/<timestamp>``, fresh for every run; prunes older demo runs, keeping a few.

    Only subdirectories of ``root`` that carry the demo's marker are ever pruned.
    """
    base = Path(root)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = base / stamp, 1
    while path.exists():
        n += 1
        path = base / f"{stamp}-{n}"
    if base.is_dir():
        ours = sorted(
            (p for p in base.iterdir() if p.is_dir() and not p.is_symlink() and (p / MARKER).is_file()),
            key=lambda p: p.stat().st_mtime,
        )
        for old in ours[: max(0, len(ours) - (_KEEP_DEFAULT_RUNS - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    return path
