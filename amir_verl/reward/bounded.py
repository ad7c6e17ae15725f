"""Run a function with a hard time limit from any thread of any caller: a pool of helper processes.

math-verify bounds itself with ``signal.alarm``, which only works in a process's main thread, while
verl's reward loop calls the score function from executor threads. So each call runs in a helper
process of a ``pebble.ProcessPool`` (one pool per calling process, started at the first call):

- every call has its own time budget, counted from when a helper starts it; a call that runs out of it
  gets ``default`` and only its helper is replaced. Other calls run on the other helpers meanwhile, so
  a pathological answer costs only its own budget (no head-of-line blocking);
- an ordinary exception inside the call gives ``default`` and the helper keeps serving;
- a pool pebble gave up on (an idle helper killed from outside) is replaced by a fresh one;
- the pool has :func:`pool_size` helpers (``reward.reward_kwargs.math_workers``; default: verl's
  reward threads, ``min(32, cores + 4)``, capped at the cores), each importing math-verify once when it
  starts, outside any call's budget.

Helpers are started with ``spawn`` WITHOUT re-running the caller's ``__main__``: multiprocessing would
otherwise re-import the calling script in every helper, which breaks a script without an
``if __name__ == "__main__":`` guard (and re-runs its top-level code). The functions run in helpers are
importable module-level functions of this package, so they never need the caller's ``__main__``.

Helpers start from daemonic processes too (a ``multiprocessing.Pool`` or DataLoader worker). Where no
helper process can start at all (process limits, a sandbox), calls run in-process, bounded by ``SIGALRM``
in the main thread (between Python instructions: one long C computation can overrun), with one warning;
from another thread they raise :class:`GraderUnavailable` with a one-line message naming the fix.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from multiprocessing.context import SpawnContext, SpawnProcess

import pebble

logger = logging.getLogger(__name__)

_pool_lock = threading.Lock()  # creating / replacing the pool
_main_lock = threading.RLock()  # hiding the caller's __main__ / daemon flag while a helper starts
_pool: pebble.ProcessPool | None = None
_pool_pid: int | None = None  # the process that owns _pool (a forked child must not use its parent's)
_pool_workers: int | None = None
_in_process = False  # no helper could start in this process: bounded in-process evaluation
_exiting = False  # set at exit: no helper starts any more (see _shutdown)


class GraderUnavailable(RuntimeError):
    """No helper process can run here and this thread cannot bound a call in-process."""


def available_cores() -> int:
    """The cores this process may use (macOS has no ``sched_getaffinity``: the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pool_size(requested: int | None = None) -> int:
    """Helpers in the pool: ``requested`` if given, else as many as verl's reward threads (the default
    executor of its reward loop, ``min(32, cores + 4)``), in both cases at most the cores."""
    cores = available_cores()
    wanted = requested if requested is not None else min(32, cores + 4)
    return max(1, min(int(wanted), cores))


@contextmanager
def _caller_main_hidden():
    """While a helper process is spawned, ``__main__`` offers multiprocessing neither a file nor a module
    name to re-import (``multiprocessing.spawn.get_preparation_data`` reads ``__main__.__spec__`` and
    ``__main__.__file__``), so the helper starts from this package alone."""
    main = sys.modules.get("__main__")
    with _main_lock:
        saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if main is not None and name in main.__dict__}
        try:
            if main is not None:
                main.__dict__.pop("__file__", None)
                main.__spec__ = None
            yield
        finally:
            if main is not None:
                main.__dict__.pop("__spec__", None)
                main.__dict__.update(saved)


class _HelperProcess(SpawnProcess):
    @staticmethod
    def _Popen(process_obj):
        with _caller_main_hidden():
            return SpawnProcess._Popen(process_obj)

    def start(self):
        """``BaseProcess.start`` refuses children of a daemonic process (a ``multiprocessing.Pool`` worker,
        a DataLoader worker), because a daemon is killed without cleaning them up; it reads
        ``current_process()._config["daemon"]``. A helper is safe to start there: it ends by itself when
        the pipe to its pool closes. So the flag is lifted while the helper starts (pinned by
        tests/test_grader_pool.py::test_a_daemonic_process)."""
        config = multiprocessing.current_process()._config
        with _main_lock:
            if _exiting:  # pebble's manager replacing a helper while this process exits: see _shutdown
                raise OSError("amir_verl grader: this process is exiting")
            daemonic = config.pop("daemon", None)
            try:
                super().start()
            finally:
                if daemonic is not None:
                    config["daemon"] = daemonic


class _HelperContext(SpawnContext):
    """``spawn`` whose processes do not re-import the caller's ``__main__`` (see module docstring)."""

    Process = _HelperProcess


def _import_math_verify() -> None:
    """Import math-verify and sympy (seconds) and run one check, outside any call's budget."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from math_verify import parse, verify

    verify(parse("$1$"), parse("$1$"), timeout_seconds=None)


def _prepare_helper() -> None:
    """pebble's initializer, in each helper before it takes calls: import math-verify and sympy once, and
    let SIGTERM end the helper at once. pebble stops a helper whose call ran out of time with SIGTERM,
    and its own handler is Python code, which cannot run while sympy is inside one long C call (a huge
    power): pebble would then wait 3 s before SIGKILL, with its pool manager, and so every other call,
    stalled meanwhile."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _import_math_verify()


def _start_pool(workers: int) -> pebble.ProcessPool:
    import importlib.util

    if importlib.util.find_spec("math_verify") is None:
        raise ImportError("amir_verl's grader needs math-verify: pip install 'math-verify>=0.7'")
    return pebble.ProcessPool(max_workers=workers, initializer=_prepare_helper, context=_HelperContext())


def _get_pool(workers: int | None) -> pebble.ProcessPool | None:
    """The pool of this process (None: in-process mode). The first call's size is kept."""
    global _pool, _pool_pid, _pool_workers
    with _pool_lock:
        if _pool is not None and _pool_pid != os.getpid():  # inherited through fork: not ours to use
            _pool, _pool_pid = None, None
        if _pool is None and not _in_process:
            size = pool_size(workers)
            _pool, _pool_pid, _pool_workers = _start_pool(size), os.getpid(), size
        elif _pool is not None and workers is not None and pool_size(workers) != _pool_workers:
            logger.warning("amir_verl grader: math_workers=%s ignored, the pool of this process already has %s "
                           "helpers", workers, _pool_workers)
        return _pool


def _discard_pool(pool: pebble.ProcessPool) -> None:
    """Drop a pool that cannot take calls: one that never started, or one in pebble's error state (a helper
    killed from outside while it waited for a call, e.g. by the OOM killer, leaves the pool's channel lock
    held and pebble stops managing the pool). The next call starts a fresh pool."""
    global _pool
    with _pool_lock:
        if _pool is not pool:  # another thread already replaced it
            return
        _pool = None
    pool.stop()
    try:
        pool.join(timeout=5)
    except Exception:  # a broken pool's helpers may be gone already: nothing more to stop
        logger.debug("amir_verl grader: stopping a broken pool", exc_info=True)


def _fall_back_in_process(error: BaseException) -> None:
    """No helper process can start here (process limits, a sandbox): grade in-process from now on."""
    global _pool, _in_process
    with _pool_lock:
        if not _in_process:
            logger.warning("amir_verl grader: no math-verify helper process could start (%s: %s); grading "
                           "in-process, bounded by SIGALRM in the main thread", type(error).__name__, error)
            _pool, _in_process = None, True
    _import_math_verify()


class _Alarm(BaseException):
    """The in-process budget ran out. A BaseException (as math-verify's own ``TimeoutException``), so that
    the ``except Exception`` blocks of math-verify and sympy cannot swallow it and go on computing."""


def _run_in_process(fn, args: tuple, timeout_s: float, default):
    """``fn(*args)`` bounded by SIGALRM (main thread only). The alarm's handler runs between Python
    instructions, so one long C call (big-integer arithmetic) can overrun the budget until it returns."""
    if threading.current_thread() is not threading.main_thread():
        raise GraderUnavailable(
            "amir_verl grader: no helper process can start in this process and this is not its main thread, "
            "so math-verify cannot be time-bounded; allow this process to start child processes, or call "
            "compute_score from its main thread")

    def on_alarm(signum, frame):
        raise _Alarm()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        try:
            return fn(*args)
        finally:  # an alarm due just as fn returns is raised here, and caught below like any other
            signal.setitimer(signal.ITIMER_REAL, 0)
    except (_Alarm, Exception):  # a timeout or an error on hostile input is "not equal"
        return default
    finally:
        signal.signal(signal.SIGALRM, previous)


def run_bounded(fn, args: tuple, timeout_s: float, default, workers: int | None = None):
    """``fn(*args)`` in a helper process; ``default`` if it runs longer than ``timeout_s`` (counted from
    when a helper starts it) or raises. ``fn`` must be a module-level function of an importable module.

    ``workers``: pool size for this process, used by the call that starts the pool (see :func:`pool_size`).
    """
    for attempt in range(2):
        pool = _get_pool(workers)
        if pool is None:
            return _run_in_process(fn, args, timeout_s, default)
        try:
            future = pool.schedule(fn, args=args, timeout=timeout_s)
            break
        except (OSError, RuntimeError) as error:  # BrokenProcessPool is a RuntimeError, and so is what a pool
            _discard_pool(pool)  # in pebble's error state raises: a fresh pool is tried once
            if attempt == 1:  # a fresh pool failed too: no helper can start here
                _fall_back_in_process(error)
                return _run_in_process(fn, args, timeout_s, default)
    try:
        return future.result()
    except FutureTimeout:  # pebble stopped the helper and starts a fresh one
        return default
    except Exception:  # an error in fn on hostile input, or a helper that died: "not equal", never a crash
        return default


@atexit.register
def _shutdown() -> None:
    """Stop the pool so that no helper prints a traceback. pebble's ``ProcessPool.join`` unlinks the pool's
    semaphores (``WorkerChannel.close``) BEFORE it stops the helpers (``PoolManager.stop``), and a helper
    still starting (one replacing a timed-out helper) unpickles those semaphores: it would fail with a
    ``FileNotFoundError`` traceback on the caller's stderr. So: refuse new helpers, kill every helper
    (none is half-way through ``start``: each start holds ``_main_lock``), and only then let pebble close
    the pool (pinned by tests/test_grader_pool.py::test_exit_right_after_timeouts_prints_nothing)."""
    global _pool, _exiting
    pool, _pool = _pool, None
    if pool is None or _pool_pid != os.getpid():
        return
    pool.stop()  # pebble's manager loop ends within its sleep unit; a start it tries meanwhile is refused
    with _main_lock:
        _exiting = True
        helpers = [child for child in multiprocessing.active_children() if isinstance(child, _HelperProcess)]
        for helper in helpers:
            helper.kill()
    for helper in helpers:
        helper.join(1)
    pool.join(timeout=5)
