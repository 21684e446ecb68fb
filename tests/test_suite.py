"""The suite's own promise: nothing it starts outlives it. A test that leaves a process running errors, naming it, and
the process is ended; a process that escapes every test (a module keeps it and never ends it) fails the whole run at
its end, named, and is ended. Checked on a pytest session of its own, with this suite's conftest, since the
session's end is the behaviour."""
import os
import subprocess
import sys
import textwrap

import processes
from runs import ROOT

LEAKS = '''
import os, subprocess, sys, time
import processes

def test_leaves_a_sleep(tmp_path):
    p = subprocess.Popen(["sleep", "1000"])
    with open(os.environ["PIDS"], "a") as f:
        f.write(f"{p.pid}\\n")

def test_a_module_keeps_one_and_never_ends_it():
    with processes.kept("a fixture that forgot it"):
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
    with open(os.environ["PIDS"], "a") as f:
        f.write(f"{p.pid}\\n")

def test_ends_what_it_starts():
    subprocess.run(["sleep", "0"], check=True)
'''


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_process_left_running_is_named_and_ended_by_its_test_or_by_the_sessions_end(tmp_path):
    (tmp_path / "test_leaks.py").write_text(textwrap.dedent(LEAKS))
    pids = tmp_path / "pids"
    # a session of its own: not this one's mark (its end would take this session's processes for its own)
    env = {k: v for k, v in os.environ.items() if k not in (processes.MARK, processes.KEEP) and not
           k.startswith(("PYTEST_", "COV_"))}
    env.update(PIDS=str(pids), PYTHONPATH=os.path.join(ROOT, "tests"), PROCESS_GRACE_S="1")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                        "-p", "no:xdist", "--rootdir", str(tmp_path), str(tmp_path / "test_leaks.py")],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    out = p.stdout + p.stderr
    sleep, kept = (int(line) for line in pids.read_text().split())
    assert p.returncode == 1, out
    assert "3 passed, 1 error" in out, out  # the leaving test passed, its teardown errs
    assert f"the test left processes running (killed now):\npid {sleep}: sleep 1000 (started in " \
           f"test_leaks.py::test_leaves_a_sleep)" in out, out
    assert "processes the suite started were still running at its end (killed now):\n" \
           f"  pid {kept}: {sys.executable} -c import time; time.sleep(1000) (started in " \
           "test_leaks.py::test_a_module_keeps_one_and_never_ends_it)" in out, out
    assert not alive(sleep) and not alive(kept)
