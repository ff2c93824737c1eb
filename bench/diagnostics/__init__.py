"""Diagnostics beside the benchmarks: they measure why, not how fast.

- ``profile_target``: one chunk_kda call (and its gradient) for Nsight Compute to profile;
- ``stalls``: Nsight Compute's warp-stall samples per SASS instruction, summarised;
- ``gate_precision``: every gradient's error against the float32 reference at fla's gate grid;
- ``pool_drift``: a 16-bit state pool's drift over many decode steps;
- ``aot_compare``: two AOT reports (files, or ``REV:PATH``), kernel by kernel.

The tests of the tools (tests/test_diagnostics.py) carry the ``diagnostics`` marker,
outside the default test run (``python -m pytest -m diagnostics``; `.ci/run` runs them
after it). The 16-bit pool's drift bound is a property of the library: its test
(tests/test_pool_drift.py) stays in the default run.
"""
