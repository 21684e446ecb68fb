"""The suite's own promise: nothing it starts outlives it. A test that leaves a process running errors, naming it, and
the process is ended; a process that escapes every test (a module keeps it and never ends it) fails the whole run at
its end, named, and is ended. Checked on a pytest session of its own, with this suite's conftest, since the
session's end is the behaviour."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import processes
from runs import ROOT

LEAKS = '''
import os, signal, subprocess, sys, time
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

def test_interrupted_while_it_waits():
    p = subprocess.Popen(["sleep", "1000"])
    forked = os.fork()
    if forked == 0:
        with open(os.environ["PIDS"] + ".part", "w") as f:
            f.write(str(signal.getsignal(signal.SIGTERM)))
        os.rename(os.environ["PIDS"] + ".part", os.environ["PIDS"] + ".sigterm")
        time.sleep(1000)
        os._exit(0)
    while not os.path.exists(os.environ["PIDS"] + ".sigterm"):
        time.sleep(0.01)
    with open(os.environ["PIDS"], "a") as f:
        f.write(f"{p.pid}\\n{forked}\\n")
    p.wait()
'''


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def inner_session(tmp_path, *args, until=None):
    """pytest on LEAKS in a session inside this one (its mark below this session's), with this suite's conftest:
    its output and exit status. until(process): a condition on which it is sent SIGTERM."""
    (tmp_path / "test_leaks.py").write_text(textwrap.dedent(LEAKS))
    env = {k: v for k, v in os.environ.items() if k != processes.KEEP and not k.startswith(("PYTEST_", "COV_"))}
    env.update(PIDS=str(tmp_path / "pids"), PYTHONPATH=os.path.join(ROOT, "tests"), PROCESS_GRACE_S="1")
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "-p",
                          "no:xdist", "--rootdir", str(tmp_path), str(tmp_path / "test_leaks.py"), *args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env)
    try:
        if until is not None:
            while not until(p) and p.poll() is None:
                time.sleep(0.05)
            p.send_signal(signal.SIGTERM)
        return p.communicate(timeout=600)[0], p.returncode
    finally:
        p.kill()
        p.wait()


def pids(tmp_path):
    """The pids the inner session's tests wrote (none yet: [])."""
    path = tmp_path / "pids"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def test_a_process_left_running_is_named_and_ended_by_its_test_or_by_the_sessions_end(tmp_path):
    outer = subprocess.Popen(["sleep", "1000"])  # this session's: the inner session's end leaves it alone
    try:
        out, status = inner_session(tmp_path, "-k", "not interrupted")
        assert alive(outer.pid), out
    finally:
        outer.kill()
        outer.wait()
    sleep, kept = pids(tmp_path)
    assert status == 1, out
    assert "3 passed, 1 deselected, 1 error" in out, out  # the leaving test passed, its teardown errs
    assert f"the test left processes running (killed now):\npid {sleep}: sleep 1000 (started in " \
           f"test_leaks.py::test_leaves_a_sleep)" in out, out
    assert "processes the suite started were still running at its end (killed now):\n" \
           f"  pid {kept}: {sys.executable} -c import time; time.sleep(1000) (started in " \
           "test_leaks.py::test_a_module_keeps_one_and_never_ends_it)" in out, out
    assert not alive(sleep) and not alive(kept)


def test_a_session_whose_tests_all_pass_fails_for_what_escaped_them(tmp_path):
    out, status = inner_session(tmp_path, "-k", "keeps")
    assert status == 1 and "1 passed" in out and "error" not in out, out
    assert not any(map(alive, pids(tmp_path)))


def test_a_sigterm_to_the_session_ends_what_it_started(tmp_path):
    """A CI's time limit (SIGTERM) in the middle of a test: the session ends as a Ctrl-C ends it, and what the test
    started (the sleep it waits on, one it forked) goes with it."""
    out, status = inner_session(tmp_path, "-k", "interrupted", until=lambda p: len(pids(tmp_path)) == 2)
    sleep, forked = pids(tmp_path)
    assert status == 2 and "KeyboardInterrupt" in out and "Traceback" not in out, out  # 2: pytest's "interrupted"
    assert f"the test left processes running (killed now):\npid {sleep}: sleep 1000 (started in " in out, out
    assert f"\npid {forked}: " in out, out
    assert not alive(sleep) and not alive(forked)
    # the child's SIGTERM is the kernel's (a pool's worker that pytest's handler would have left running once)
    assert (tmp_path / "pids.sigterm").read_text() == str(signal.SIG_DFL)


def test_a_process_just_started_is_found_as_the_sessions():
    """Popen returns once vfork lets the parent go, which can be before the new program's arguments and environment
    are in place (nearly always, on a loaded machine): such a process is still this session's, with its arguments."""
    for _ in range(20):
        p = subprocess.Popen(["sleep", "1000"])
        try:
            process = processes.read(p.pid)
        finally:
            p.kill()
            p.wait()
        assert process is not None and process.argv == ("sleep", "1000"), process
