from __future__ import annotations

import os

# keep every process in the tests to one compute thread (CI has 2 cores)
os.environ.setdefault("OMP_NUM_THREADS", "1")
