"""The math-verify helper pool: time budgets per response, no head-of-line blocking, helpers that survive
ordinary errors, and every kind of caller (scripts with and without a main guard, an interactive
interpreter, threads, a Ray actor, a daemonic process)."""

import operator
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from amir_verl.reward import compute_score
from amir_verl.reward.answers import is_correct
from amir_verl.reward.bounded import pool_size, run_bounded
from tests.pool_calls import sleep_then_pid
from tests.support import start_local_ray

SLOW_ANSWER = "9^{9^{9^{9}}}"  # sympy works on it longer than any budget here
RESPONSE = "<think> x </think> <answer> {} </answer> <confidence> 0.9 </confidence>"


def helper_pids() -> set[int]:
    """The pids of all helpers: one call per helper, each holding its helper long enough that every
    helper takes one."""
    results = []
    threads = [threading.Thread(target=lambda: results.append(run_bounded(sleep_then_pid, (0.5,), 30.0, None)))
               for _ in range(pool_size())]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return set(results)


def all_helper_pids(deadline_s: float = 90.0) -> set[int]:
    """:func:`helper_pids` once every helper is ready (a fresh one imports sympy first)."""
    deadline = time.monotonic() + deadline_s
    while len(pids := helper_pids()) < pool_size() and time.monotonic() < deadline:
        time.sleep(0.5)
    return pids


def test_pool_size_defaults_to_verls_reward_threads_capped_at_the_cores():
    cores = len(os.sched_getaffinity(0))
    assert pool_size() == min(32, cores + 4, cores) == cores
    assert pool_size(1) == 1 and pool_size(10_000) == cores


def test_an_ordinary_exception_gives_the_default_and_keeps_the_helper():
    before = all_helper_pids()
    assert len(before) == pool_size() and None not in before
    assert run_bounded(operator.truediv, (1, 0), 5.0, "default") == "default"
    assert run_bounded(int, ("not a number",), 5.0, "default") == "default"
    assert all_helper_pids() == before  # no helper was replaced


def test_a_timeout_replaces_only_its_own_helper():
    before = all_helper_pids()
    started = time.monotonic()
    assert run_bounded(time.sleep, (30,), 1.0, "timed out") == "timed out"
    assert time.monotonic() - started < 5.0
    after = all_helper_pids()
    assert len(after) == len(before) and len(after - before) == 1  # one fresh helper, the others kept


def test_one_budget_per_response_whatever_the_number_of_golds():
    before = all_helper_pids()
    started = time.monotonic()
    assert not is_correct("Hothan/OlympiadBench", SLOW_ANSWER, ["1", "2", "3", "4"], math_timeout_s=1.0)
    assert time.monotonic() - started < 3.0  # 4 golds, one budget of 1 s (not 4 s)
    assert len(all_helper_pids() - before) == 1  # one call timed out: one helper replaced, whatever the load


def test_a_pathological_response_does_not_block_the_others():
    """While one thread's response runs out its 3 s budget, another thread's 20 ordinary responses are graded
    at their usual pace (the pool has a helper per core, so they never queue behind it)."""
    if pool_size() < 2:
        pytest.skip("needs two cores for two helpers")
    ordinary = [("math-ai/minervamath", RESPONSE.format(f"\\frac{{{i}}}{{7}}"), f"\\frac{{{i}}}{{7}}") for i in range(20)]
    all_helper_pids()

    def grade_ordinary() -> float:
        started = time.monotonic()
        assert all(compute_score(*item)["acc"] == 1.0 for item in ordinary)
        return time.monotonic() - started

    alone = grade_ordinary()
    slow = threading.Thread(target=compute_score, args=("math-ai/aime25", RESPONSE.format(SLOW_ANSWER), "5"),
                            kwargs={"math_timeout_s": 3.0})
    slow.start()
    time.sleep(0.2)
    beside_the_slow_one = grade_ordinary()
    slow.join()
    assert beside_the_slow_one < 3.0 and beside_the_slow_one < alone + 1.5, (alone, beside_the_slow_one)


# ----------------------------------------------------------------------------- every kind of caller

def run_python(args: list[str], stdin: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                          env=env)


GRADE = textwrap.dedent("""\
    import time
    from amir_verl.reward import compute_score
    good = compute_score("math-ai/minervamath", "<think> x </think> <answer> \\\\frac{1}{2} </answer> <confidence> 0.9 </confidence>", "\\\\frac{1}{2}")
    start, cpu_start = time.monotonic(), time.process_time()
    # ((9!)!)! runs sympy for longer than any budget here, in Python-level steps between big-integer C calls,
    # so SIGALRM can stop it too (the in-process fallback)
    slow = compute_score("math-ai/aime25", "<answer> ((9!)!)! </answer>", "5", math_timeout_s=1.0)
    print("RESULT", good["acc"], slow["acc"])
    print("SECONDS", time.monotonic() - start, time.process_time() - cpu_start)
    """)


def assert_graded(result: subprocess.CompletedProcess, clean_stderr: bool = True, in_process: bool = False) -> None:
    """GRADE's two answers graded, and the slow one stopped by its 1 s budget. A helper's budget is wall
    time, counted by the caller, which only waits: the wall time is bounded. In-process, SIGALRM's second
    is wall time too, but the C call it falls in (a big factorial) finishes first, and on a loaded machine
    that call's CPU second can take many wall seconds: this process's CPU time is bounded."""
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RESULT 1.0 0.0" in result.stdout, result.stdout + result.stderr[-3000:]
    wall_s, cpu_s = (float(value) for value in result.stdout.split("SECONDS ")[1].split()[:2])
    assert wall_s >= 1.0, (wall_s, cpu_s)  # the slow answer ran out of its budget: the bound was tested
    assert (cpu_s if in_process else wall_s) < 6, (wall_s, cpu_s)
    if clean_stderr:
        assert "Traceback" not in result.stderr, result.stderr[-3000:]


EXIT_WHILE_A_HELPER_STARTS = textwrap.dedent("""\
    import multiprocessing, time
    from amir_verl.reward import compute_score
    compute_score("math-ai/minervamath", "<answer> 1 </answer>", "1")  # the pool is up
    before = {p.pid for p in multiprocessing.active_children()}
    def replacement_started():
        return bool({p.pid for p in multiprocessing.active_children()} - before)
    slow = compute_score("math-ai/aime25", "<answer> 9^{9^{9^{9}}} </answer>", "5", math_timeout_s=0.3)
    deadline = time.monotonic() + 10  # pebble replaces the timed-out helper: exit while the replacement starts
    while not replacement_started() and time.monotonic() < deadline:
        time.sleep(0.001)
    print("RESULT", slow["acc"], replacement_started())
    """)


def test_exit_right_after_timeouts_prints_nothing(tmp_path):
    """A script that exits while a helper replacing a timed-out one is still starting: pebble's own close
    would unlink the semaphores that helper is unpickling (a FileNotFoundError traceback, seen in 3 of 5
    runs before the exit hook killed starting helpers first). Five runs, every one silent."""
    script = tmp_path / "exit_while_a_helper_starts.py"
    script.write_text(EXIT_WHILE_A_HELPER_STARTS)
    for _ in range(5):
        result = run_python([str(script)], timeout=60)
        assert result.returncode == 0 and "RESULT 0.0 True" in result.stdout, result.stdout + result.stderr[-3000:]
        assert result.stderr == "", result.stderr[-3000:]


def test_a_script_without_a_main_guard(tmp_path):
    script = tmp_path / "score.py"
    script.write_text(GRADE + 'print("TOP LEVEL RAN")\n')
    result = run_python([str(script)])
    assert_graded(result)
    assert result.stdout.count("TOP LEVEL RAN") == 1  # the helpers did not re-run the caller's script


def test_a_script_with_a_main_guard(tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text('def main():\n' + textwrap.indent(GRADE, "    ") + '\nif __name__ == "__main__":\n    main()\n')
    assert_graded(run_python([str(script)]))


def test_a_module_run_with_dash_m(tmp_path):
    (tmp_path / "grade_module.py").write_text(GRADE)
    result = run_python(["-c", "import runpy, sys; sys.path.insert(0, sys.argv[1]); runpy.run_module('grade_module', "
                         "run_name='__main__', alter_sys=True)", str(tmp_path)])
    assert_graded(result)


def test_an_interactive_interpreter():
    assert_graded(run_python(["-i", "-q"], stdin=GRADE))


def test_several_threads_of_a_script(tmp_path):
    script = tmp_path / "threads.py"
    script.write_text(textwrap.dedent("""\
        from concurrent.futures import ThreadPoolExecutor
        from amir_verl.reward import compute_score
        items = [("openai/gsm8k", f"<answer> {i} </answer>", str(i)) for i in range(20)]
        items += [("math-ai/amc23", f"<answer> \\\\frac{{{i}}}{{3}} </answer>", f"\\\\frac{{{2 * i}}}{{6}}") for i in range(1, 21)]
        items += [("deepmind/aqua_rat", "<answer> (B) </answer>", "B")] * 10
        with ThreadPoolExecutor(8) as pool:
            accs = list(pool.map(lambda item: compute_score(*item)["acc"], items))
        print("RESULT", sum(accs), len(accs))
        """))
    result = run_python([str(script)])
    assert result.returncode == 0 and "RESULT 50.0 50" in result.stdout, result.stdout + result.stderr[-3000:]


def test_a_ray_actor():
    """verl's reward workers are Ray actors."""
    import ray

    start_local_ray(num_cpus=1)
    try:
        @ray.remote
        class Grader:
            def grade(self, answer, gold):
                from amir_verl.reward import compute_score

                return compute_score("math-ai/minervamath", f"<answer> {answer} </answer>", gold)["acc"]

        grader = Grader.remote()
        assert ray.get(grader.grade.remote("\\frac{2}{4}", "\\frac{1}{2}"), timeout=180) == 1.0
        assert ray.get(grader.grade.remote("\\frac{2}{5}", "\\frac{1}{2}"), timeout=60) == 0.0
    finally:
        ray.shutdown()


def test_grading_from_a_daemonic_pool_worker(tmp_path):
    """multiprocessing.Pool workers are daemonic and multiprocessing refuses them children; the grader's
    helpers start there all the same (time limit intact, also from a thread)."""
    (tmp_path / "grade_snippet.py").write_text(GRADE)
    path = tmp_path / "daemonic.py"
    path.write_text(textwrap.dedent("""\
        import multiprocessing, threading

        def grade(_):
            daemonic = multiprocessing.current_process().daemon
            import grade_snippet  # grades at import: prints RESULT from the daemonic worker
            from amir_verl.reward import compute_score
            results = []
            thread = threading.Thread(target=lambda: results.append(
                compute_score("openai/gsm8k", "<answer> 3 </answer>", "3")["acc"]))
            thread.start(); thread.join()
            return daemonic, results

        if __name__ == "__main__":
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                print("FROM A THREAD", pool.map(grade, [0])[0])
        """))
    result = run_python([str(path)])
    # Pool's exit SIGTERMs its worker (no atexit) while the helper replacing the timed-out one may still be
    # starting: that helper's spawn can then print a traceback. Teardown noise, not a grading error.
    assert_graded(result, clean_stderr=False)
    assert "FROM A THREAD (True, [1.0])" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "in-process" not in result.stderr  # real helpers, not the fallback


def test_a_helper_killed_from_outside_gets_a_fresh_pool_not_the_in_process_fallback(tmp_path):
    """SIGKILL of an idle helper (the OOM killer's choice, say) leaves pebble's channel lock held and the
    pool in its error state; the next call starts a fresh pool: graded by helpers, from a thread too, with
    the time limit intact."""
    path = tmp_path / "killed.py"
    path.write_text(textwrap.dedent("""\
        import multiprocessing, os, signal, threading, time
        from amir_verl.reward import compute_score
        assert compute_score("math-ai/minervamath", "<answer> 1 </answer>", "1")["acc"] == 1.0
        os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
        time.sleep(1.0)  # pebble notices and gives up on the pool
        results = []
        thread = threading.Thread(target=lambda: results.append(
            compute_score("math-ai/amc23", "<answer> \\\\frac{2}{4} </answer>", "\\\\frac{1}{2}")["acc"]))
        thread.start(); thread.join()
        start = time.monotonic()
        slow = compute_score("math-ai/aime25", "<answer> 9^{9^{9^{9}}} </answer>", "5", math_timeout_s=1.0)
        print("RESULT", results, slow["acc"], time.monotonic() - start < 6)
        """))
    result = run_python([str(path)])
    assert result.returncode == 0 and "RESULT [1.0] 0.0 True" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "in-process" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]


# sympy and math-verify catch Exception around their steps: the in-process alarm must get through such a loop
SWALLOW_EVERY_EXCEPTION = textwrap.dedent("""\
    def swallow_every_exception():
        until = time.monotonic() + 20
        while time.monotonic() < until:
            try:
                sum(range(10_000))
            except Exception:
                pass
        return "ran on"
    print("SWALLOWED", bounded.run_bounded(swallow_every_exception, (), 0.5, "stopped"))
    """)


def test_without_helper_processes_grading_falls_back_in_process(tmp_path):
    """Where no process can start (simulated: every helper start fails as a refused fork would), the main
    thread grades in-process under SIGALRM after one warning; another thread gets one clear line."""
    path = tmp_path / "no_children.py"
    path.write_text("\n".join([
        "from amir_verl.reward import bounded",
        "def refuse(self):",
        "    raise OSError('fork refused')",
        "bounded._HelperProcess.start = refuse",
        GRADE,
        "import threading",
        "errors = []",
        "def from_a_thread():",
        "    try:",
        "        compute_score('math-ai/aime25', '<answer> 5 </answer>', '5')",
        "    except bounded.GraderUnavailable as error:",
        "        errors.append(str(error))",
        "thread = threading.Thread(target=from_a_thread); thread.start(); thread.join()",
        "print('THREAD ERROR', len(errors), '\\n' not in errors[0])",
        SWALLOW_EVERY_EXCEPTION,
    ]))
    result = run_python([str(path)])
    assert_graded(result, in_process=True)
    assert "THREAD ERROR 1 True" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "SWALLOWED stopped" in result.stdout, result.stdout + result.stderr[-3000:]
    assert result.stderr.count("grading in-process") == 1
