"""SeqBounds registers itself as a static pytree where it is defined
(kda_jax/bounds.py), not as a side effect of another module, and bounds.py
still imports without JAX."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import jax
import numpy as np

BOUNDS_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "kda_jax", "bounds.py")


def _load_alone(name):
    """bounds.py as a module of its own: nothing else of kda_jax runs."""
    spec = importlib.util.spec_from_file_location(name, BOUNDS_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[name]
    return mod


def test_bounds_module_registers_seqbounds_as_a_static_pytree():
    mod = _load_alone("_bounds_alone")
    b = mod.SeqBounds.from_lengths([2, 0, 3])
    leaves, treedef = jax.tree_util.tree_flatten(b)
    assert leaves == []  # unregistered, the object itself would be the one leaf
    assert jax.tree_util.tree_unflatten(treedef, []) == b
    # Equal contents: equal treedefs, so one jit cache entry.
    assert treedef == jax.tree_util.tree_structure(mod.SeqBounds(np.array([0, 2, 2, 5])))


def test_bounds_module_imports_without_jax():
    code = (
        "import importlib.util, sys\n"
        "sys.modules['jax'] = None  # import jax now raises ImportError\n"
        f"spec = importlib.util.spec_from_file_location('b', {BOUNDS_PY!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['b'] = m\n"
        "spec.loader.exec_module(m)\n"
        "print(m.SeqBounds.from_lengths([1, 2]).total_tokens)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"
