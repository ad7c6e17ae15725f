"""Run a function with a hard time limit from any thread.

math-verify bounds itself with ``signal.alarm``, which only works in a process's main thread; verl's
reward loop calls the score function from executor threads. So the call runs in a helper process
(``spawn``, one per calling process, reused). Calls from several threads take turns: each call's time
limit covers only its own work, and a call that runs out of time kills and replaces the helper without
disturbing any other call.
"""

from __future__ import annotations

import atexit
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

WARM_UP_TIMEOUT_S = 300.0

_lock = threading.Lock()  # one call in the helper at a time
_pool: ProcessPoolExecutor | None = None


def _warm_up() -> bool:
    """Import the heavy modules once, outside any call's time limit."""
    from math_verify import parse, verify

    return verify(parse("$1$"), parse("$1$"))


def _get_pool() -> ProcessPoolExecutor:
    global _pool
    if _pool is None:
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        pool.submit(_warm_up).result(timeout=WARM_UP_TIMEOUT_S)
        _pool = pool
    return _pool


def _discard_pool() -> None:
    global _pool
    pool, _pool = _pool, None
    if pool is not None:
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)


def run_bounded(fn, args: tuple, timeout_s: float, default):
    """``fn(*args)`` in the helper process; ``default`` if it runs longer than ``timeout_s`` or fails.

    ``fn`` must be importable (a module-level function): it is pickled to the helper.
    """
    with _lock:
        pool = _get_pool()  # a helper that cannot start (math-verify missing) is an install error: raise
        try:
            return pool.submit(fn, *args).result(timeout=timeout_s)
        except FutureTimeout:
            _discard_pool()
            return default
        except Exception:  # an error in fn on hostile input, or a dead helper: "not equal", never a crash
            _discard_pool()
            return default


@atexit.register
def _shutdown() -> None:
    _discard_pool()
