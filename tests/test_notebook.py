"""notebooks/train_gpt2.ipynb, run in a real Jupyter kernel at CPU scale: a small local corpus, a
tiny model, a few steps, the install skipped. The checks are on what a user sees: one line about
the GPU, the trainer's step lines in the training cell's streamed output, the plot as an image,
and sample text. The notebook reads its settings from GPT2_NB_* environment variables, which the
kernel inherits from this process."""
import os
import random
import re
import sys

import pytest

import runs

WHY = "the notebook test needs nbformat, nbclient and ipykernel: pip install nbformat nbclient ipykernel"
nbformat = pytest.importorskip("nbformat", reason=WHY)
nbclient = pytest.importorskip("nbclient", reason=WHY)
pytest.importorskip("ipykernel", reason=WHY)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "train_gpt2.ipynb")
STEPS = 6
PROMPT = "Once upon a time"
WORDS = ("the a cat dog sat on mat ran to house and then saw big small red blue tree bird sang happy sad day "
         "night sun moon went home played with friend ball park water ate food slept").split()


@pytest.fixture
def warm_kernel(monkeypatch):
    """The kernel, and the scripts the notebook starts with the kernel's sys.executable, started warm: real processes
    running the real scripts, without torch's import in each (tests/warm.py). jupyter_client starts a kernel spec's
    "python" as sys.executable; tiny models gain nothing from OpenMP's threads."""
    monkeypatch.setattr(sys, "executable", runs.python())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_notebook_prepares_trains_plots_and_samples(tmp_path, monkeypatch, warm_kernel):
    rng = random.Random(0)
    corpus = tmp_path / "corpus.txt"  # ~13K tokens: a val split of ~1,300, more than one batch of 8 x 32
    corpus.write_text("\n\n".join(" ".join(rng.choices(WORDS, k=rng.randint(20, 60))) + "." for _ in range(300)))
    settings = dict(REPO=ROOT, DATA_FILES=str(corpus), CORPUS_TOKENS="100000", PROMPT=PROMPT, SKIP_INSTALL="1",
                    TRAIN_ARGS=f"--n-layer 2 --n-head 2 --n-embd 32 --block-size 32 --total-batch-size 256 "
                               f"--max-steps {STEPS} --hellaswag-every 0 --sample-every 0 --device cpu",
                    SAMPLE_ARGS="--device cpu --max-new-tokens 20")
    for name, value in settings.items():
        monkeypatch.setenv("GPT2_NB_" + name, value)
    for name in ("COLAB_RELEASE_TAG", "KAGGLE_KERNEL_RUN_TYPE"):  # as on a machine of one's own: ./log
        monkeypatch.delenv(name, raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # the kernel starts in tmp_path: ./data and ./log go there
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    cells = {c.metadata["tags"][0]: c for c in nb.cells if c.cell_type == "code"}

    def printed(tag):
        return "".join(o.get("text", "") for o in cells[tag].outputs if o.output_type == "stream")

    gpu = printed("gpu")
    assert gpu.count("\n") == 1 and gpu.startswith(("GPU: ", "no GPU (", "nvidia-smi lists ")), gpu
    assert printed("install") == (f"$ pip install -q -r {os.path.join(ROOT, 'requirements.txt')}\n"
                                  "install skipped (GPT2_NB_SKIP_INSTALL=1)\n")
    assert printed("logdir") == f"log directory: {tmp_path / 'log'}\n"
    train = printed("train")
    step_line = re.compile(r"^step +(\d+) \| loss \d", re.M)
    assert [int(n) for n in step_line.findall(train)] == list(range(STEPS)), train
    # streamed: the step lines came as the trainer printed them, in messages of their own, not all at the end
    assert sum(bool(step_line.search(o.text)) for o in cells["train"].outputs if o.output_type == "stream") > 1
    assert f"checkpoint {tmp_path / 'log'}" in train and os.path.isfile(tmp_path / "log" / f"ckpt_{STEPS:06d}.pt")
    assert any("image/png" in o.get("data", {}) for o in cells["plot"].outputs)
    sample = re.search(rf"^{re.escape(PROMPT)}(.+)", printed("sample"), re.M | re.S)
    assert sample and sample.group(1).strip(), printed("sample")


@pytest.mark.parametrize("gpu,legacy", [(("Tesla P100-PCIE-16GB", "6.0"), True), (("Tesla T4", "7.5"), False)])
def test_install_takes_torch_from_wheels_with_kernels_for_the_gpu(tmp_path, monkeypatch, fake_nvidia_smi, gpu, legacy,
                                                                 warm_kernel):
    """Kaggle's P100: pip's default torch has no kernels for it, so the install cell, finding no torch
    here that trains on it (this one is a CPU build), takes one from PyTorch's CUDA 12.6 builds
    (device.LEGACY_WHEELS, which the cell names too) before the requirements. A T4 keeps pip's choice."""
    import device
    fake_nvidia_smi([gpu])
    for name, value in dict(REPO=ROOT, SKIP_INSTALL="1").items():
        monkeypatch.setenv("GPT2_NB_" + name, value)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells = [c for c in nb.cells if c.cell_type == "code" and c.metadata["tags"][0] in ("parameters", "code", "gpu",
                                                                                          "install")]
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    steps = [f"$ pip install -q -r {os.path.join(ROOT, 'requirements.txt')}",
             "install skipped (GPT2_NB_SKIP_INSTALL=1)"]
    if legacy:
        steps[:0] = ["$ pip uninstall -y -q torch", f"$ pip install -q 'torch>=2.9' --index-url {device.LEGACY_WHEELS}"]
    assert printed.splitlines() == steps
    assert f'LEGACY_WHEELS = "{device.LEGACY_WHEELS}"' in "".join(nb.cells[-1].source)
