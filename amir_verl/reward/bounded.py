"""Run a function with a hard time limit from any thread.

math-verify bounds itself with ``signal.alarm``, which only works in a process's main thread; verl's
reward loop calls the score function from an executor thread. So the call runs in a helper process
(``spawn``, one per calling process, reused); on a timeout that process is killed and replaced and the
caller gets ``default``.
"""

from __future__ import annotations

import atexit
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

_lock = threading.Lock()
_pool: ProcessPoolExecutor | None = None


WARM_UP_TIMEOUT_S = 300.0


def _warm_up() -> bool:
    """Import the heavy modules once, outside any call's time limit."""
    from math_verify import parse, verify

    return verify(parse("$1$"), parse("$1$"))


def _get_pool() -> ProcessPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            pool.submit(_warm_up).result(timeout=WARM_UP_TIMEOUT_S)
            _pool = pool
        return _pool


def _discard_pool(pool: ProcessPoolExecutor) -> None:
    global _pool
    with _lock:
        if _pool is pool:
            _pool = None
    for process in list(getattr(pool, "_processes", {}).values()):
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def run_bounded(fn, args: tuple, timeout_s: float, default):
    """``fn(*args)`` in the helper process; ``default`` if it takes longer than ``timeout_s`` or fails."""
    pool = _get_pool()
    try:
        return pool.submit(fn, *args).result(timeout=timeout_s)
    except FutureTimeout:
        _discard_pool(pool)
        return default
    except BrokenProcessPool:
        _discard_pool(pool)
        return default
    except Exception:  # an error inside fn on hostile input counts as "not equal", never crashes a run
        return default


@atexit.register
def _shutdown() -> None:
    if _pool is not None:
        _discard_pool(_pool)
