"""tests/warm.py, the warm python the tests start the scripts with: what a process started by it shows its parent
(exit status, death by a signal, its streams, signals passed on) is what the interpreter's own start shows, and a
start that could differ warm (an environment read at import, file descriptors beyond the standard three, a copy of
the project's modules beside the script) runs the interpreter itself."""
import os
import signal
import subprocess
import sys
import time

import pytest

import processes
import runs
import warm

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the warm python needs Linux (fork, pidfd)")

PROGRAM = """
import os, signal, sys, time
print("out", sys.argv[1:], flush=True)
print("err", file=sys.stderr, flush=True)
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "raise":
    raise ValueError("from the script")
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[1] == "wait":
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(5)))
    print("ready", flush=True)
    time.sleep(60)
if sys.argv[1] == "torch":
    print("torch" in sys.modules, os.getpid())
"""


def both(args, **kw):
    """(the interpreter's own run of PROGRAM, the warm one's): their exit statuses and streams."""
    return [subprocess.run([python, "-c", PROGRAM] + args, capture_output=True, text=True, env=runs.ENV, timeout=120,
                           **kw) for python in (sys.executable, runs.python())]


@pytest.mark.parametrize("args", [["exit", "0"], ["exit", "3"], ["raise"], ["kill"]])
def test_a_warm_start_ends_as_a_cold_one(args):
    cold, hot = both(args)
    assert (hot.returncode, hot.stdout, hot.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert hot.returncode == (int(args[1]) if args[0] == "exit" else 1 if args[0] == "raise" else -signal.SIGKILL)


def test_a_warm_start_has_torch_already_and_is_a_process_of_its_own():
    hot = subprocess.run([runs.python(), "-c", PROGRAM, "torch"], capture_output=True, text=True, env=runs.ENV,
                         timeout=120)
    preloaded, pid = hot.stdout.splitlines()[-1].split()
    assert preloaded == "True" and int(pid) != os.getpid()


def test_signals_reach_the_warm_process():
    proc = subprocess.Popen([runs.python(), "-c", PROGRAM, "wait"], stdout=subprocess.PIPE, text=True, env=runs.ENV)
    assert proc.stdout.readline() == "out ['wait']\n" and proc.stdout.readline() == "ready\n"  # its handler set
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.read() == "got SIGTERM\n" and proc.wait(timeout=60) == 5


def test_a_killed_shim_takes_its_process_with_it(tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    proc = subprocess.Popen([runs.python(), "-c", code], env=runs.ENV)
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    child = int(pid_file.read_text())
    process = processes.read(child)
    assert process is not None, f"process {child} is not found as the session's"
    proc.kill()
    proc.wait()
    # its keeper kills it once it sees the shim's end: a bound on a hang, not a guess of how long that takes
    assert processes.end([process], grace=120) == [], f"process {child} outlived its shim"



def test_what_could_start_differently_starts_cold(tmp_path):
    """An environment that imports read, extra file descriptors, a module beside the script that shadows a
    preloaded one, and a process that a fixture keeps (a SLURM job's: its mark must be in its own environment, and a
    forked child shows the zygote's): each runs the interpreter itself (torch not imported)."""
    probe = "import sys; print('torch' in sys.modules)"
    for env in (dict(runs.ENV, TORCHINDUCTOR_COORDINATE_DESCENT_TUNING="1"), dict(runs.ENV, **{processes.KEEP: "x"})):
        assert subprocess.run([runs.python(), "-c", probe], capture_output=True, text=True, env=env).stdout == "False\n"
    r, w = os.pipe()
    try:
        out = subprocess.run([runs.python(), "-c", probe], capture_output=True, text=True, env=runs.ENV, pass_fds=[w])
    finally:
        os.close(r)
        os.close(w)
    assert out.stdout == "False\n"
    (tmp_path / "common.py").write_text("")  # another revision's common.py beside the script
    (tmp_path / "script.py").write_text(probe)
    out = subprocess.run([runs.python(), str(tmp_path / "script.py")], capture_output=True, text=True, env=runs.ENV)
    assert out.stdout == "False\n"
    assert subprocess.run([runs.python(), "-c", probe], capture_output=True, text=True,
                          env=runs.ENV).stdout == "True\n"  # the same, warm
    assert warm.import_time(runs.ENV) == warm.import_time(dict(runs.ENV, TORCHELASTIC_RUN_ID="x"))


def test_a_script_leaves_what_it_imported_out_of_the_collections():
    """common.run_script, every script's entry point, freezes what exists when main starts (gc.freeze), so that no
    collection walks it again, the interpreter's exit least of all (in a process of its own: frozen is for good)."""
    code = ("import gc, common; gc.collect(); imported = [[] for _ in range(1000)]; before = gc.get_freeze_count(); "
            "print(common.run_script(gc.get_freeze_count) - before)")
    p = subprocess.run([sys.executable, "-c", code], cwd=runs.ROOT, env=runs.ENV, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and int(p.stdout) >= 1000, p.stdout + p.stderr
