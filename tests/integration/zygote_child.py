"""What the zygote test forks: says what it was given, then exits with the code it was asked for,
or waits for a signal (``pause``)."""

from __future__ import annotations

import os
import random
import signal
import sys

print("argv", sys.argv[1:], "env", os.environ.get("ZYGOTE_TEST"), "cwd", os.getcwd(),
      "torch", "torch" in sys.modules, "sigint", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      "random", random.random(), flush=True)
if sys.argv[1] == "pause":
    signal.pause()
sys.exit(int(sys.argv[2]))
