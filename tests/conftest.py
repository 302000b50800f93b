from __future__ import annotations

import os

# the tier guard: only tests marked ``cluster`` may start processes
from tests.process_guard import (  # noqa: F401  (pytest finds hooks by name)
    pytest_addoption,
    pytest_configure,
    pytest_runtest_call,
    pytest_runtest_setup,
    pytest_runtest_teardown,
    pytest_terminal_summary,
)

# pytester runs an inner pytest session in this process (the guard's own test)
pytest_plugins = ("pytester",)

# keep every process in the tests to one compute thread (CI has 2 cores)
os.environ.setdefault("OMP_NUM_THREADS", "1")
