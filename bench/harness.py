"""The runner every benchmark shares: the peers behind one interface, and the results file.

- :class:`Peers` is the run's PyTorch child (``bench.fla_peer``: fla's and cuDNN's KDA ops,
  fla's decode and serving calls; or ``bench.layer_fla``: fla's layer). It starts at the
  first job and again after one dies; a child that fails raises :class:`PeerUnavailable`,
  and :meth:`Peers.rows` turns that into rows that say why, so a benchmark records it and
  goes on.
- :func:`tree_rows` times another kda_jax source tree ("tree:PATH") with the same benchmark
  module in a child process, so a replaced design is measured in the run of its successor.
- :class:`Results` holds a run's rows, stamped with the run's metadata (bench.meta) and the
  peers' versions, and rewrites its JSON after every row: a run cut short keeps what it
  measured.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

from bench import meta as run_meta
from bench.fla_peer import FlaPeer, FlaUnavailable

PeerUnavailable = FlaUnavailable

# "tree:PATH" names another source tree: PATH holds kda_jax/ with its kernels, e.g. from
# `git archive REV kda_jax | tar -x -C PATH`.
TREE = "tree:"


class Peers:
    """The PyTorch child of a run (``argv``: the child's command, default bench.fla_peer's),
    started at the first job and again after one dies; a child that does not start is not
    tried again (torch or fla is missing: every later job gets the same reason).
    ``enabled=False`` (a benchmark's --no-fla) makes every job's rows "unavailable"
    without starting anything."""

    def __init__(self, argv=None, enabled: bool = True):
        self.argv, self.enabled = argv, enabled
        self.child, self.versions, self.failed = None, {}, None

    @property
    def usable(self) -> bool:
        """On, and not known to be missing."""
        return self.enabled and self.failed is None

    def start(self):
        """Starts the child where none runs; raises PeerUnavailable where it does not start
        (now or before) or the peers are off."""
        if not self.enabled:
            raise PeerUnavailable("the peers are off (--no-fla)")
        if self.failed is not None:
            raise PeerUnavailable(self.failed)
        if self.child is None:
            try:
                self.child = FlaPeer(self.argv) if self.argv else FlaPeer()
            except PeerUnavailable as e:
                self.failed = str(e)
                raise
            self.versions.update({k: v for k, v in self.child.versions.items() if v})

    def tail(self) -> str:
        """The child's last lines that were not messages (its warnings and tracebacks)."""
        return self.child.tail() if self.child is not None else ""

    def run(self, job: dict):
        """Yields the child's messages for ``job``; raises PeerUnavailable when the child
        does not start or dies (messages already yielded stand)."""
        self.start()
        try:
            yield from self.child.run(job)
        except PeerUnavailable:
            self.close()
            raise

    def rows(self, job: dict, label: str = "fla"):
        """Yields the rows of ``job`` (the child's {"row": ...} messages); a message with an
        error, or a child that fails, gives one row {"ms": None, "error" or "unavailable"}
        and is printed to stderr under ``label``."""
        try:
            for msg in self.run(job):
                if "row" in msg:
                    yield msg["row"]
                else:
                    print(f"  {label} failed: {msg.get('error', msg)}", file=sys.stderr)
                    yield {"ms": None, "error": str(msg.get("error", msg))[-400:]}
        except PeerUnavailable as e:
            print(f"  {label} failed: {e}", file=sys.stderr)
            yield {"ms": None, **why_unavailable(e)}

    def close(self):
        if self.child is not None:
            self.child.close()
            self.child = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def why_unavailable(e: Exception, started: bool = False) -> dict:
    """{"error": text} where a child died mid-run (or after giving rows: ``started``),
    {"unavailable": text} where it never ran."""
    text = str(e)[-400:]
    return {"error" if started or "died" in text else "unavailable": text}


class Results:
    """A run's rows, written to ``path`` (a JSON list) after every change, each row
    stamped with the run's metadata and the versions ``peers`` reported."""

    def __init__(self, module: str, argv, path: str | None, peers: Peers | None = None,
                 **fields):
        self.path, self.peers, self.fields = path, peers, fields
        self.meta = run_meta.run_metadata(module, argv)
        self.rows: list[dict] = []

    def add(self, *rows: dict):
        self.rows.extend(rows)
        self.save()

    def replace(self, rows: list[dict]):
        self.rows = list(rows)
        self.save()

    def stamped(self) -> list[dict]:
        versions = {**self.meta["versions"], **(self.peers.versions if self.peers else {})}
        meta = dict(self.meta, versions=versions)
        return run_meta.stamp([dict(r, **self.fields) for r in self.rows], meta)

    def save(self):
        run_meta.write_rows(self.path, self.stamped())


def check_tree(path: str):
    """Raises ValueError, naming ``path``, where it holds no kda_jax/ source tree."""
    if not os.path.isfile(os.path.join(path, "kda_jax", "__init__.py")):
        raise ValueError(f"{TREE + path!r}: {path!r} holds no kda_jax/ source tree (make one "
                         "with `git archive REV kda_jax | tar -x -C PATH`)")


def tree_rows(path: str, module: str, argv: list[str]) -> tuple[list[dict], str, int]:
    """Another source tree's rows (TREE): ``python -m module *argv --json TMP`` in a child
    process with ``path`` first on sys.path (two kda_jax versions cannot share a process);
    the benchmark modules still come from this checkout. Returns the child's rows (each
    with "tree_commit"), its stderr's tail, which says why where rows are missing, and its
    exit status (a child that fails partway leaves the rows it wrote)."""
    check_tree(path)
    fd, out = tempfile.mkstemp(suffix=".json", prefix="kda-bench-tree-")
    os.close(fd)
    # The tree goes before sys.path's first entry (the working directory, which may hold
    # this checkout's kda_jax).
    start = (f"import runpy, sys; sys.path.insert(0, {os.path.abspath(path)!r}); "
             f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    paths = [os.getcwd(), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    proc = subprocess.run([sys.executable, "-c", start, *argv, "--json", out], env=env,
                          capture_output=True, text=True)
    try:
        with open(out) as f:
            records = json.load(f)
    except (OSError, ValueError):
        records = []
    finally:
        if os.path.exists(out):
            os.remove(out)
    commit = tree_commit(path)
    return ([dict(r, tree_commit=commit) for r in records], (proc.stderr or "")[-400:],
            proc.returncode)


def tree_commit(path: str):
    """The commit a TREE directory names (its basename when that is a hex revision)."""
    name = os.path.basename(os.path.normpath(path))
    return name if re.fullmatch(r"[0-9a-f]{7,40}", name) else None


def add_tree_argument(p):
    """The --tree option of a benchmark that times kda_jax only through its own rows."""
    p.add_argument("--tree", action="append", default=[], metavar="PATH", type=_tree_path,
                   help="another kda_jax source tree (PATH holds kda_jax/): the same rows "
                        "timed with it in a child process, labelled 'tree:PATH' (repeatable)")


def _tree_path(path: str) -> str:
    import argparse

    try:
        check_tree(path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return path


def tree_rows_of(path: str, module: str, argv, drop=("--json", "--tree", "--rounds"),
                 label_field: str = "implementation", **fields) -> list[dict]:
    """The rows of ``module`` run again with the source tree ``path`` (tree_rows): the same
    command line less the options in ``drop`` (spelled out in full: the benchmark's parser
    takes no abbreviations), with --no-fla. Each row's ``label_field`` starts with
    "tree:PATH"; where the child failed (even after some rows), one more row says why,
    with ``fields``."""
    check_tree(path)
    args, skip = [], False
    for a in sys.argv[1:] if argv is None else argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in drop:
            skip = "=" not in a
            continue
        args.append(a)
    rows, stderr, status = tree_rows(path, module, [*args, "--no-fla"])
    label = TREE + path
    out = [dict(r, **{label_field: f"{label} {r.get(label_field, '')}".strip()}) for r in rows]
    if status != 0 or not rows:
        out.append({**fields, label_field: label, "ms": None,
                    "error": f"exit status {status}: {stderr or 'no row'}",
                    "tree_commit": tree_commit(path)})
    return out
