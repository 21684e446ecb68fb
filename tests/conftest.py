"""Fixtures shared by the test modules: network probes for the tests that need the internet,
the tiny random GPT that the HellaSwag and sampling tests score and sample from, and an
nvidia-smi that lists GPUs this machine does not have."""
import gc
import os
import signal
import socket
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import processes  # noqa: E402
processes.mark_session()  # before anything starts: every process of the session inherits the mark
import warm  # noqa: E402  (the environment the tests' processes start in, taken before any test adds to it)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# the test modules (rewritten by pytest for its assertions) and the project's are compiled once, into __pycache__
# (ignored by git), even where the environment (PYTHONDONTWRITEBYTECODE, -B) says not to write bytecode: each
# worker and launch compiles them otherwise
sys.dont_write_bytecode = False
if os.environ.get("PYTEST_XDIST_WORKER"):
    # the workers share the cores: OpenMP threads of one would wait on cores busy with another's
    torch.set_num_threads(1)


def interrupted(signum, frame):
    """A SIGTERM (a CI's time limit) ends the session as a Ctrl-C does: its teardowns and its end run."""
    raise KeyboardInterrupt


def sigterm_ends_it():
    # a child forked without a new program (a pool's worker) is not the session: SIGTERM ends it, as the kernel
    # does (a handler could be left unrun, the signal come as the child enters a blocking wait)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def pytest_collection_finish(session):
    # what the imports made lives as long as the process: the collections after each run need not walk it again
    gc.collect()  # (what is garbage already is not frozen for good)
    gc.freeze()


@pytest.fixture(autouse=True)
def ends_what_it_starts(request):
    """Every process a test starts ends with the test, however the test ended: what is still running after its
    teardown (a rank a killed torchrun left, a child its parent did not wait for) is killed, and the test errors,
    naming each (a session interrupted in the test ends interrupted, naming each)."""
    before = set(processes.of_tests(processes.session(), warm.zygote_session()))
    yield
    left = [p for p in processes.of_tests(processes.session(), warm.zygote_session()) if p not in before]
    killed = processes.end(left) if left else []
    if killed:
        message = "the test left processes running (killed now):\n" + "\n".join(map(str, killed))
        # an interrupted test's teardown runs at the session's end: an error there would end it in a traceback
        if request.session.exitstatus != pytest.ExitCode.INTERRUPTED:
            pytest.fail(message, pytrace=False)
        say(request.config, message)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """The session ends with every process it started: each worker ends its warm zygote; the process that ran the
    session (pytest-xdist's controller, once its workers are gone, or pytest alone) kills what is left of the session
    and fails the run, naming each."""
    warm.stop_zygote()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    killed = processes.end(processes.not_helpers(processes.session()), grace=3 * processes.GRACE_S)
    if killed:
        say(session.config, "\n".join(["processes the suite started were still running at its end (killed now):"]
                                       + [f"  {p}" for p in killed]))
        if session.exitstatus != pytest.ExitCode.INTERRUPTED:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def say(config, message):
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter:
        reporter.line("")  # (the progress line may be open)
    for line in message.splitlines():
        reporter.write_line(line, red=True) if reporter else print(line, file=sys.stderr)


def reachable(host, port=443, timeout=3.0):
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def hf_hub_online():
    import common
    problem = common.hub_unreachable(timeout=3.0)  # the probe the scripts make before a download
    if problem:
        pytest.skip(f"the Hugging Face hub is not reachable from this machine: {problem}")


@pytest.fixture(scope="session")
def github_online():
    if not reachable("raw.githubusercontent.com"):
        pytest.skip("raw.githubusercontent.com (the official HellaSwag file) is not reachable (offline)")


@pytest.fixture
def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago, for a process group's store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """lists(gpus): an nvidia-smi first on PATH that answers for these GPUs, [(name, "6.0"), ...], as the
    real one does to `-L` and to `--query-gpu=name,compute_cap --format=csv,noheader` (or to a query
    of compute_cap alone)."""
    def lists(gpus):
        if os.name == "nt":
            pytest.skip("a shell script stands in for nvidia-smi")
        bindir = tmp_path / "fake-bin"
        bindir.mkdir(exist_ok=True)
        listing = "".join(f"echo 'GPU {i}: {name} (UUID: GPU-{i})'\n" for i, (name, _) in enumerate(gpus))
        query = "".join(f"echo '{name}, {cap}'\n" for name, cap in gpus)
        caps = "".join(f"echo '{cap}'\n" for _, cap in gpus)
        (bindir / "nvidia-smi").write_text(
            "#!/bin/sh\n"
            f'case "$*" in\n  -L) {listing};;\n  *name,compute_cap*) {query};;\n  *compute_cap*) {caps};;\n'
            "  *) exit 6;;\nesac\n")
        (bindir / "nvidia-smi").chmod(0o755)
        monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return lists


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine OpenMP's barriers make each
    small op wait for a descheduled thread (milliseconds per op)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    """A 2-layer GPT with a 64-token context, random weights, in eval mode."""
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64)).eval()


def shared(tmp_path_factory, name, build):
    """A folder that build(path) fills once for the whole session, every test worker included: the first worker to
    ask builds it under a file lock, the others wait for it and read it. Tests only read it."""
    import fcntl
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' common folder
    path = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / ".built").exists():
            if path.exists():  # a build cut short
                import shutil
                shutil.rmtree(path)
            path.mkdir()
            build(str(path))
            (path / ".built").touch()
    return str(path)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """Shards of learnable text for the tiny trainer runs (runs.TINY)."""
    from runs import write_shards
    return shared(tmp_path_factory, "data", write_shards)


@pytest.fixture(scope="session")
def reference_run(data_dir, tmp_path_factory):
    """An uninterrupted 10-step run that the resume tests must reproduce bit for bit."""
    from runs import run, tiny
    return shared(tmp_path_factory, "ref", lambda log_dir: run(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=10,
                                                                     checkpoint_every=3)))


@pytest.fixture
def train_in_process():
    """runs.train: the trainer in this process, a bad input raised as its UserError."""
    from runs import train
    return train


# Module fixtures that cost seconds (a run, a pair of ranks): the tests that use one go to one test worker, which
# builds it once (pytest-xdist's --dist loadgroup hands a group to one worker; without xdist the mark does nothing)
SHARED_IN_MODULE = ("two_ranks", "logged_run", "one_process", "bad_input_setup", "six_steps", "damaged_resume",
                    "bundle", "files", "logs", "log_dir", "gguf_files")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        fixture = next((f for f in SHARED_IN_MODULE if f in item.fixturenames), None)
        if fixture is not None:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}.{fixture}"))


def pytest_configure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the process whose end ends what the session started
        signal.signal(signal.SIGTERM, interrupted)
        os.register_at_fork(after_in_child=sigterm_ends_it)
    # pytest-xdist's own marker, named here too so that a run without it does not warn
    config.addinivalue_line("markers",
                            "xdist_group(name): the tests pytest-xdist's --dist loadgroup runs in one process")
