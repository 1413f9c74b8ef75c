"""asyncrl: asynchronous actor-learner RL for language models."""

import os as _os

__version__ = "0.1.0"

# Bounded OpenMP spinning, set before anything loads torch (libgomp reads it once, when torch is
# imported; child processes inherit it). By default a libgomp thread that reaches the end of a
# parallel region spins for ~300k iterations waiting for its partners. When other work shares the
# cores, the partner is often descheduled, and a torch op with two threads waits out a scheduler
# time slice. Measured on the 2-core machine (README, Benchmarks): building the embedded model with 2
# threads (40 warm-start steps) beside two busy processes took 8.8-90.6 s with the default and
# 6.0-7.0 s with a spin count of 1,000 (one 100-step build took 541 s with the default); the same
# weights bit for bit, and about the same time on the quiet machine. The
# quick start with 2 threads in both learner and actor, async, made 247 completions/s with the
# default and 584-592 with 1,000. 1,000 is what libgomp itself uses when it knows the cores are
# oversubscribed. A user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY is left as it is.
OPENMP_SPINCOUNT = "1000"
if "GOMP_SPINCOUNT" not in _os.environ and "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT
