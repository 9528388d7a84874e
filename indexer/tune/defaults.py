"""The tuner's defaults, importable without FAISS or torch (the command line's help states
them)."""

from __future__ import annotations

FAMILIES = ("hnsw", "ivf", "ivfip", "ivfpq", "ivfsq")
MIN_TIMING_S = 0.25  # each timing runs at least this long (twice, in turn with flat search)
SERVED_BATCH = 16  # the batch a worker forms under load: 32 connections over two workers
# An approximate index must serve this many times flat search's queries per second (at the
# served batch size) to be picked: a smaller gain is not worth the lost recall, and timings on a
# shared machine vary by more.
MIN_SPEEDUP = 1.5
# After this long, with some structure meeting the target, the tuner tries no more (seconds).
BUDGET_S = 600.0
