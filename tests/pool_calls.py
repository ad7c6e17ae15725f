"""What the grader pool's tests send its helpers. A helper imports the module of each function it is sent (the
function is pickled by name), so these live in a module that imports nothing heavy: sent from a test module,
they made every helper import that module and, through ``tests.support``, verl (about 7 s of CPU a helper)."""

import os
import time


def sleep_then_pid(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()
