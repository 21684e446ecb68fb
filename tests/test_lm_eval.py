"""The trainer's Hugging Face export (LOG_DIR/hf) read by EleutherAI's lm-evaluation-harness, offline,
with a task file of its own: its log-likelihoods of each answer equal our scorer's on the same items.
Skipped where lm_eval is not installed (README's test command leaves it out: 33 packages, ~210 MB;
`pip install lm-eval accelerate` runs it)."""
import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import hellaswag
from export import write_hf
import scoring
from model import GPT, GPTConfig
from tokenizer import gpt2_bpe_files

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("accelerate") is None,
    reason="lm-evaluation-harness is not installed (pip install lm-eval accelerate)")

TASK = """task: gpt2_train_check
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_reads_the_export_and_agrees_with_our_scorer(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64)).eval()
    exported = write_hf(model, str(tmp_path / "hf"), tokenizer_files=gpt2_bpe_files())
    items = [{"ctx": f"The cat sees item {i} and", "label": i % 4,
              "endings": ["runs.", "sleeps all day.", "a b c.", "flies away over the old house."]} for i in range(12)]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "check.yaml").write_text(TASK.format(items=tmp_path / "items.jsonl"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    p = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                        f"pretrained={exported},dtype=float32", "--tasks", "gpt2_train_check", "--include_path",
                        str(tmp_path / "tasks"), "--device", "cpu", "--batch_size", "4", "--output_path",
                        str(tmp_path / "out"), "--log_samples"], capture_output=True, text=True, env=env,
                       timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    results = json.load(open(glob.glob(str(tmp_path / "out" / "*" / "results_*.json"))[0]))
    samples = [json.loads(line) for line in open(glob.glob(str(tmp_path / "out" / "*" / "samples_*.jsonl"))[0])]
    # lm-eval's log-likelihood of " " + ending after the context: minus our summed loss of the ending
    share = scoring.share_of(hellaswag.HellaSwag(items), model.config.block_size)
    *_, (sums, _, _) = scoring.scored_batches(model, share.rows, "cpu")
    sums = sums.view(-1, 4)
    theirs = torch.tensor([[-float(r[0][0]) for r in s["resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])],
                          dtype=torch.float64)
    torch.testing.assert_close(theirs, sums, rtol=1e-4, atol=1e-4)
    ours = scoring.evaluate(model, hellaswag.HellaSwag(items))
    assert results["results"]["gpt2_train_check"]["acc,none"] == ours["acc"]
