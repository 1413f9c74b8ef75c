"""asyncrl: asynchronous actor-learner RL for language models."""

import os as _os

__version__ = "0.1.0"

# Bounded OpenMP spinning, set before anything loads torch (libgomp reads it once, when torch is
# imported; child processes inherit it). libgomp's default lets a thread that reaches the end of a
# parallel region spin for ~300k iterations waiting for its partners. When other processes share the
# cores, the partner is often descheduled, so every torch op with two threads waits out a scheduler
# time slice: building the embedded model (2 threads, 100 warm-start steps) took 541 s beside two busy
# processes on the 2-core machine, against 5.7 s on the quiet machine. With a spin count of 10,000 it
# took 12.5 s beside them and 6.2 s quiet, and built the same weights bit for bit (README, Benchmarks).
# A user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY is left as it is.
OPENMP_SPINCOUNT = "10000"
if "GOMP_SPINCOUNT" not in _os.environ and "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT
