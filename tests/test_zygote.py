"""The zygote's processes behave as the ``python -c`` processes they replace, and start with torch imported.

The death, fork and rank tests rely on it: a script's exit code, output and
signal death read as a ``subprocess.Popen``'s would, and its atexit hooks
run (also in a child it forks), as the client's slot cleanup needs.
"""

from __future__ import annotations

import os
import signal
import textwrap

from zygote import Script, run_script

HOOKS = textwrap.dedent("""
    import atexit, os, sys
    atexit.register(lambda: print("atexit", os.getpid(), flush=True))
    pid = os.fork()
    if pid == 0:
        sys.exit(5)  # an exit through SystemExit, in a child the script forked
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])  # the child has printed and exited
    print("script", os.getpid(), flush=True)
    print("child", pid, status, flush=True)
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
""")


def test_a_script_never_sees_what_a_test_put_in_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("CKPTD_FAULTS", "[]")  # set while the zygote may be starting: it must not keep it
    out = run_script("import os; print(os.environ.get('CKPTD_FAULTS'))", timeout=60)
    assert out.stdout == "None\n", out


def test_a_script_exits_prints_and_runs_its_atexit_hooks_as_python_c_would() -> None:
    out = run_script(HOOKS, "3", timeout=60)
    assert out.returncode == 3 and out.stderr == "to stderr\n", out
    lines = [line.split() for line in out.stdout.splitlines()]
    pids = {line[0]: int(line[1]) for line in lines if line[0] != "atexit"}
    assert ["child", str(pids["child"]), "5"] in lines  # the child's exit code
    assert sorted(int(line[1]) for line in lines if line[0] == "atexit") == sorted(pids.values())


def test_an_exception_exits_one_with_its_traceback() -> None:
    out = run_script("raise ValueError('named')", timeout=60)
    assert out.returncode == 1 and "ValueError: named" in out.stderr


def test_a_killed_script_reads_as_killed_by_its_signal_and_starts_with_torch_imported() -> None:
    proc = Script("import sys, time; print('torch' in sys.modules, flush=True); time.sleep(60)")
    assert proc.stdout.readline().strip() == "True"  # imported by the zygote, before the script ran
    assert proc.poll() is None and os.path.exists(f"/proc/{proc.pid}")
    proc.kill()
    assert proc.wait(10) == -signal.SIGKILL
