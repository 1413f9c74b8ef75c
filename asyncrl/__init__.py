"""asyncrl: asynchronous actor-learner RL for language models."""

import os as _os

__version__ = "0.1.0"

# Bounded OpenMP spinning, set before anything loads torch (libgomp reads it once, when torch is
# imported; child processes inherit it). By default a libgomp thread that reaches the end of a
# parallel region spins ~300k iterations waiting for its partners; when other work shares the cores
# the partner is often descheduled, and each two-thread torch op waits out a scheduler time slice.
# 1,000 is what libgomp itself uses when it knows the cores are oversubscribed. Measurements: docs/results/benchmarks.md,
# "OpenMP spinning". A user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY is left as it is.
OPENMP_SPINCOUNT = "1000"
if "GOMP_SPINCOUNT" not in _os.environ and "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT
