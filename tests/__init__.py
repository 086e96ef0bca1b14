"""The test suite. Imported before any conftest, so before anything loads torch."""

import os

# Torch's CPU build runs its ops on OpenMP threads that spin while they wait for one
# another. On a runner whose cores others also use (a shared CI box), a spinning thread
# waits out whole scheduler slices for a descheduled sibling: with one of two cores
# busy elsewhere, the coalesce benchmark's smoke test went from 40 s to over 300 s, and
# to 52 s with waiting threads sleeping instead. Set here, it reaches every process a
# test starts (workers inherit it); a value set by the caller wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
