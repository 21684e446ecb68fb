"""
What produced a run or a data set, as its run header (train_gpt2.py) and its manifest (fineweb.py)
record it: the versions of Python, PyTorch and the libraries, and the git commit of this checkout.
"""

import importlib.util
import os
import platform
import runpy
import subprocess
import sys


def versions(*extra):
    """Versions of Python, torch (and its CUDA), numpy, tiktoken and the `extra` modules that import."""
    out = {"python": platform.python_version()}
    out["torch"], out["cuda"] = torch_versions()
    for name in ("numpy", "tiktoken") + extra:
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            pass
    return out


def torch_versions():
    """torch.__version__ and torch.version.cuda, read from torch/version.py where torch is not imported:
    fineweb.py records them but runs no torch, whose import is a second of its start-up."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.__version__, torch.version.cuda
    spec = importlib.util.find_spec("torch")  # finds the package without running it
    if spec is None:
        return None, None
    version = runpy.run_path(os.path.join(spec.submodule_search_locations[0], "version.py"))
    return version["__version__"], version["cuda"]


def git_commit():
    """The short commit of this checkout ('-dirty' with uncommitted changes), or None outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (rev + ("-dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None
