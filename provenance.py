"""What produced a run or a data set, as train_gpt2.py's run record, fineweb.py's manifest and bench/ladder.py's
results record it: the versions of the libraries, the environment variables that change how torch runs, the commit."""

import importlib
import importlib.util
import os
import platform
import runpy
import subprocess


def versions(*extra):
    """Versions of Python, torch (and its CUDA), numpy, tiktoken and the `extra` modules that import."""
    out = {"python": platform.python_version(), "torch": None, "cuda": None}
    spec = importlib.util.find_spec("torch")  # read, not imported: fineweb.py runs no torch, a second to import
    if spec is not None:
        torch_version = runpy.run_path(os.path.join(spec.submodule_search_locations[0], "version.py"))
        out["torch"], out["cuda"] = torch_version["__version__"], torch_version["cuda"]
    for name in ("numpy", "tiktoken") + extra:
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            pass
    return out


# variables that change how torch compiles, allocates and communicates: a run's record holds those set
ENVIRONMENT_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_", "TRITON_", "PYTORCH_", "NCCL_", "CUBLAS_", "CUDNN_")
ENVIRONMENT_NAMES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


def environment():
    """{name: value} of the environment variables set here that change how torch compiles and runs."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENVIRONMENT_PREFIXES) or k in ENVIRONMENT_NAMES}


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
