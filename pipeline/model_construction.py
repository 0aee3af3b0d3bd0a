"""One transformers model built at a time in a process.

transformers builds a model in a given dtype by switching torch's *process-wide* default dtype for
the duration (`local_torch_dtype`) and switching it back after. Two builds on two threads interleave
those switches: one island's restore lands in the middle of the other's build, which then gets some
float32 layers among its bf16 ones and fails every forward pass ("expected m1 and m2 to have the same
dtype"). Workers are one process each in a deployment, but a process may hold several (the in-process
test runs a trainer and two islands), so every build goes through this lock.
"""

from __future__ import annotations

import threading

MODEL_CONSTRUCTION = threading.Lock()
"""Held while transformers builds or loads a model (`from_config`, `from_pretrained`)."""
