"""What test_up forks: kvpool up's stop wait, with a second stop signal sent inside the first one's handler."""

import os, signal, sys
from kvpool.tools.up import wait_for_stop_signal

fired = set()

def stop_handler_code():
    handler = signal.getsignal(signal.SIGINT)
    return getattr(handler, "__code__", None)

def in_stop_handler(frame):
    code = stop_handler_code()
    while frame is not None:
        if code is not None and frame.f_code is code:
            return True
        frame = frame.f_back
    return False

def second_signal(why):
    if why not in fired:
        fired.add(why)
        os.kill(os.getpid(), signal.SIGTERM)

def tracer(frame, event, arg):
    # a second stop signal arrives while the first one's handler runs: as it starts, and right after it
    # takes any lock (Ctrl-C pressed twice, or a wrapper such as timeout forwarding its own signal)
    if event == "call" and frame.f_code is stop_handler_code():
        second_signal("handler")
    elif event == "return" and frame.f_code.co_name in ("__enter__", "acquire") and in_stop_handler(frame):
        second_signal("lock")
    return tracer

def tick():
    if not fired:
        sys.settrace(tracer)
        os.kill(os.getpid(), signal.SIGINT)

for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
got = wait_for_stop_signal(tick)
sys.settrace(None)
print("stopped by", signal.Signals(got).name, sorted(fired))
