"""The loop shared by the config tuners: each grid entry changes a base config,
is timed and checked under it, and becomes one record; a config that fails to
compile is a record too (with its error), not the end of the run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from bench.harness import Results


def run_grid(base, changes, measure: Callable, shape) -> list[dict]:
    """Records of ``measure(config) -> (ms, {error name: value})`` for each
    config ``kda_jax.configs.replace(base, change)`` (a change: {path:
    value}); prints each as it lands."""
    from kda_jax import configs

    records = []
    for change in changes:
        cfg = configs.replace(base, change)
        try:
            ms, acc = measure(cfg)
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result
            print(f"{change}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
            ms, acc = None, {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        records.append({"config": configs.as_dict(cfg), "change": change,
                        "shape": list(shape), "ms": ms, **acc})
        print(json.dumps({"change": change, "ms": ms, **acc}), flush=True)
    return records


def write_records(path: str | None, module: str, argv, records: list[dict]):
    """The run's JSON: one row per record, each with the run's metadata (bench.meta)."""
    Results(module, argv, path).add(*records)


def parse_grid_args(doc: str, grids: dict, default: str, argv):
    """(args, (B, T, H)) of a tuner's command line: --shape B,T,H, --grid NAME
    (one of ``grids``), --json PATH."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--shape", default="1,8192,32")
    p.add_argument("--grid", default=default, choices=sorted(grids))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    return args, tuple(int(x) for x in args.shape.split(","))
