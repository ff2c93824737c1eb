"""What every benchmark row records about its run: date, commit, versions, machine, command.

One helper for all of them, so that a row of any results file says where it
came from: ``run_metadata`` gives the fields, ``stamp`` adds them to rows, and
``write_rows`` writes the JSON (a list of flat rows).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys

PACKAGES = ("jax", "jaxlib", "triton", "jax_triton", "torch", "fla", "cudnn_frontend")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state() -> dict:
    """{"commit": short hash or None, "dirty": bool or None} of the checkout (None
    where git or the repository is absent, e.g. an installed copy)."""
    commit = _git("rev-parse", "--short=12", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def versions(packages=PACKAGES) -> dict:
    """Python's version and each package's ``__version__`` (None where not importable).
    fla and cuDNN's frontend are looked up without importing them where possible (importing
    them pulls in torch)."""
    out = {"python": platform.python_version()}
    for name in packages:
        out[name] = _version_of(name)
    return out


def _version_of(name: str) -> str | None:
    from importlib import metadata

    dist = {"jax_triton": "jax-triton", "fla": "fla-core",
            "cudnn_frontend": "nvidia-cudnn-frontend"}.get(name, name)
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    try:
        return getattr(__import__(name), "__version__", None)
    except Exception:  # noqa: BLE001 - a missing package is recorded as None
        return None


def machine() -> dict:
    """The GPU's name and driver (nvidia-smi, else rocm-smi, else JAX's device kind),
    and the host's platform string."""
    gpu = driver = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            gpu, _, driver = out.stdout.strip().splitlines()[0].partition(", ")
    except (OSError, subprocess.SubprocessError):
        pass
    if gpu is None:
        try:
            out = subprocess.run(["rocm-smi", "--showproductname", "--showdriverversion",
                                  "--csv"], capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                gpu = out.stdout.strip().splitlines()[-1]
        except (OSError, subprocess.SubprocessError):
            pass
    if gpu is None and "jax" in sys.modules:
        try:
            gpu = str(sys.modules["jax"].devices()[0].device_kind)
        except Exception:  # noqa: BLE001
            gpu = None
    return {"gpu": gpu, "driver": driver or None, "platform": platform.platform()}


def run_metadata(module: str, argv=None, **extra_versions) -> dict:
    """The fields every row of a run carries. ``extra_versions`` (e.g. torch, fla as
    the fla child reported them) replace the ones found here."""
    args = sys.argv[1:] if argv is None else list(argv)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **git_state(),
        "versions": {**versions(), **{k: v for k, v in extra_versions.items() if v}},
        "machine": machine(),
        "command": " ".join(["python", "-m", module, *args]),
    }


def stamp(rows: list[dict], meta: dict) -> list[dict]:
    """Each row with the run's metadata added (the row's own fields first)."""
    return [{**row, **meta} for row in rows]


def write_rows(path: str | None, rows: list[dict]):
    """Writes ``rows`` as a JSON list to ``path`` (nothing without a path)."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")
