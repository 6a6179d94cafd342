"""The grammar compile threads at interpreter exit: running work finishes (a daemon thread
retaking the GIL inside llguidance while the interpreter finalizes crashes the process),
queued work never starts, and the wait is bounded."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from cpud.structured.compiler import GrammarCompiler
from cpud.text.tokenizer import Tokenizer

SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from cpud.structured.pool import CompilePool

    done, queued, wait_s, work_s = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    pool = CompilePool(1, exit_wait_s=wait_s)
    started = threading.Event()

    def running():
        started.set()
        time.sleep(work_s)  # releases the GIL, as llguidance's calls do
        open(done, "w").write("finished")

    pool.submit(running)
    pool.submit(lambda: open(queued, "w").write("ran"))
    started.wait(10)
    print("exiting", flush=True)
    """
)


def run_script(tmp_path, wait_s: float, work_s: float) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "done"), str(tmp_path / "queued")]
        + [str(wait_s), str(work_s)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return run, time.monotonic() - started


def test_exit_waits_for_the_running_compile_and_drops_the_queued(tmp_path):
    run, _ = run_script(tmp_path, wait_s=30, work_s=0.5)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "exiting\n"
    assert (tmp_path / "done").read_text() == "finished"
    assert not (tmp_path / "queued").exists()
    assert run.stderr == ""


def test_the_exit_wait_is_bounded_and_said(tmp_path):
    run, seconds = run_script(tmp_path, wait_s=0.3, work_s=20)
    assert run.returncode == 0, run.stderr
    assert seconds < 15
    assert not (tmp_path / "done").exists()
    assert "grammar compile was still running 0.3 s after exit began" in run.stderr


def test_the_tokenizer_is_prepared_on_a_compile_thread(model_factory):
    compiler = GrammarCompiler(Tokenizer(model_factory("llama")))
    assert compiler.prepare_in_background().result(60) is None
    assert compiler._ll_tokenizer is not None
