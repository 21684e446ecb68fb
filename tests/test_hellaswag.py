"""hellaswag.py on a tiny random GPT: scores against a plain re-computation of the definition,
batched against one item at a time, the split across 2 gloo ranks, data loading and bad input."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import common  # noqa: E402
import hellaswag  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1")  # for the scripts run as subprocesses (see one_thread)

# Hand-written items in the official format (the extra keys are there to be ignored).
CONTEXTS = [
    ("A man is sitting on a roof. he", ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                                        "is holding a rubik's cube.", "starts pulling up roofing on a roof."], 3),
    ("A woman pours flour into a bowl. She", ["cracks two eggs into it.", "jumps.", "sings a long song about "
                                              "the sea and the mountains far away.", "stirs."], 0),
    ("The cat", ["sat.", "sat on the mat by the door.", "flew over the moon, which was bright.", "ran."], 1),
    ("Kids are playing soccer in a park. One boy", ["kicks the ball.", "kicks the ball into the net and "
                                                    "cheers.", "eats.", "reads a book under a tree."], 0),
    ("Héllo wörld, 世界 😀. Someone", ["waves.", "says hi 👋.", "leaves the room quietly.", "."], 2),
    ("", ["An empty context.", "A.", "B", "C"], 3),
    ("A chef slices onions", ["quickly.", "and cries a little as he does so.", "with a knife.", "badly."], 2),
]
ITEMS = [{"ind": i, "activity_label": "test", "ctx_a": ctx, "ctx_b": "", "ctx": ctx, "split": "val",
          "split_type": "indomain", "label": label, "endings": endings, "source_id": f"test~{i}"}
         for i, (ctx, endings, label) in enumerate(CONTEXTS)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory, model):
    d = tmp_path_factory.mktemp("hellaswag")
    data = d / "hellaswag_val.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS), encoding="utf-8")
    ckpt = d / "ckpt_000001.pt"
    common.save_checkpoint(str(ckpt), {"model_config": asdict(model.config), "model": model.state_dict()})
    return {"data": str(data), "ckpt": str(ckpt), "dir": d}


def reference(model, items):
    """The definition, one ending at a time: context + " " + ending, cross-entropy over the ending."""
    enc = common.get_tokenizer()
    sums, means = [], []
    for item in items:
        ctx = enc.encode(item["ctx"]) or [common.EOT_TOKEN]  # an empty context: <|endoftext|>
        s = []
        for ending in item["endings"]:
            end = enc.encode(" " + ending)
            tokens = torch.tensor(ctx + end)
            logits, _ = model(tokens[None, :-1])
            losses = F.cross_entropy(logits[0].float(), tokens[1:], reduction="none")[len(ctx) - 1:]
            s.append((losses.sum().item(), losses.mean().item()))
        sums.append([a for a, _ in s])
        means.append([b for _, b in s])
    return torch.tensor(sums, dtype=torch.float64), torch.tensor(means, dtype=torch.float64)


@torch.no_grad()
def test_scores_match_reference(model):
    sums_ref, means_ref = reference(model, ITEMS)
    sums, counts = hellaswag.score_items(model, ITEMS, "cpu", batch_size=3)
    torch.testing.assert_close(sums, sums_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sums / counts, means_ref, rtol=1e-5, atol=1e-4)
    labels = torch.tensor([item["label"] for item in ITEMS])
    result = hellaswag.evaluate(model, ITEMS, "cpu", batch_size=3)
    assert result == {"acc": (sums_ref.argmin(1) == labels).double().mean().item(),
                      "acc_norm": (means_ref.argmin(1) == labels).double().mean().item(), "n": len(ITEMS)}


@torch.no_grad()
def test_batched_equals_one_at_a_time(model):
    one = hellaswag.score_items(model, ITEMS, "cpu", batch_size=1)
    for batch_size in (2, 16):  # 7 items: a short last batch, and one batch larger than the set
        sums, counts = hellaswag.score_items(model, ITEMS, "cpu", batch_size=batch_size)
        torch.testing.assert_close(sums, one[0], rtol=1e-5, atol=1e-4)
        assert torch.equal(counts, one[1])
    assert hellaswag.evaluate(model, ITEMS, "cpu", batch_size=1) == hellaswag.evaluate(model, ITEMS, "cpu")


def test_context_longer_than_block_size_is_cut_from_the_front(model):
    enc = common.get_tokenizer()
    item = {"ctx": "word " * 100, "endings": ["one two three", "four", "five six", "seven"], "label": 0}
    ctx, endings = hellaswag.render(item, enc, model.config.block_size)
    assert endings == [enc.encode(" " + e) for e in item["endings"]]  # endings whole
    assert len(ctx) + max(len(e) for e in endings) == 64  # the longest row just fits
    assert ctx == enc.encode(item["ctx"])[-len(ctx):]  # the end of the context is kept
    sums, counts = hellaswag.score_items(model, [item], "cpu")
    assert counts[0].tolist() == [len(e) for e in endings]
    # each ending scored as in its own row: the cut context, then the ending
    for j, e in enumerate(endings):
        tokens = torch.tensor(ctx + e)
        logits, _ = model(tokens[None, :-1])
        loss = F.cross_entropy(logits[0], tokens[1:], reduction="none")[len(ctx) - 1:].sum()
        assert sums[0, j].item() == pytest.approx(loss.item(), rel=1e-4)


def test_packed_row_matches_separate_rows(model):
    """The packing itself: positions restart after the context for each ending, and an ending
    sees the context and itself only, so its logits equal those of its own unpacked row."""
    ctx, endings = [5, 6, 7], [[8, 9], [10], [11, 12, 13], [14]]
    tokens, pos, seg = hellaswag.pack(ctx, endings)
    assert pos == [0, 1, 2, 3, 4, 3, 3, 4, 5, 3]
    assert seg == [0, 0, 0, 1, 1, 2, 3, 3, 3, 4]
    seg_t = torch.tensor([seg + [-1, -1]])  # two padding tokens
    mask = hellaswag.attention_mask(seg_t)
    assert mask[0, 0, 3].tolist() == [True] * 4 + [False] * 8  # ending 0's first token
    assert mask[0, 0, 11].tolist() == [True] * 3 + [False] * 7 + [True] * 2  # padding: context + padding
    idx = torch.tensor([tokens + [0, 0]])
    packed, _ = model(idx, pos=torch.tensor([pos + [0, 0]]), mask=mask)
    at = len(ctx)
    for e in endings:
        alone, _ = model(torch.tensor([ctx + e]))
        torch.testing.assert_close(packed[0, at:at + len(e)], alone[0, len(ctx):], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[0, :len(ctx)], alone[0, :len(ctx)], rtol=1e-5, atol=1e-5)
        at += len(e)


def test_compiled_model_and_train_state(model):
    compiled = torch.compile(model, backend="eager")  # dynamo's wrapper, without inductor's compile time
    model.train()
    try:
        # batches of 12 rows, the last one (4 rows) padded to 12 for the compiled model
        assert hellaswag.evaluate(compiled, ITEMS, "cpu", batch_size=3) == hellaswag.evaluate(model, ITEMS, "cpu")
        assert model.training  # restored
    finally:
        model.eval()
    assert not model.training


def test_shard_covers_every_item_once():
    for n in (0, 1, 7, 10):
        for world in (1, 2, 3):
            got = [i for r in range(world) for i in hellaswag.shard(n, r, world)]
            assert sorted(got) == list(range(n))


def rank_worker(rank, world_size, port, ckpt, data, out):
    """One of 2 ranks: gloo on loopback, set up by common.setup_distributed as under torchrun."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    d = common.setup_distributed("cpu")
    seen = []
    score_items = hellaswag.score_items

    def recording(model, items, *args, **kwargs):
        seen.extend(item["ctx"] for item in items)
        return score_items(model, items, *args, **kwargs)

    hellaswag.score_items = recording
    model, _ = common.load_model(ckpt, "cpu")
    result = hellaswag.evaluate(model, hellaswag.load_items(data), "cpu", batch_size=2, rank=d.rank,
                                world_size=d.world_size)
    common.teardown_distributed()
    with open(f"{out}{rank}.json", "w") as f:
        json.dump({"seen": seen, "result": result}, f)


def test_two_gloo_ranks_split_and_reduce(model, files, tmp_path):
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "rank")
    # fork: the children start at once, without importing torch again (spawn elsewhere)
    method = "fork" if sys.platform == "linux" else "spawn"
    ctx = mp.start_processes(rank_worker, args=(2, port, files["ckpt"], files["data"], out), nprocs=2,
                             join=False, start_method=method)
    deadline = time.time() + 120
    while not ctx.join(timeout=1):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the 2 gloo ranks did not finish within 120 s")
    ranks = [json.load(open(f"{out}{r}.json")) for r in range(2)]
    seen = ranks[0]["seen"] + ranks[1]["seen"]
    assert sorted(seen) == sorted(item["ctx"] for item in ITEMS)  # every item once, none twice
    assert len(ranks[0]["seen"]) == 4 and len(ranks[1]["seen"]) == 3
    assert ranks[0]["result"] == ranks[1]["result"] == hellaswag.evaluate(model, ITEMS, "cpu")


# ----------------------------------------------------------------------------------------------
# Data


def test_load_items(files):
    items = hellaswag.load_items(files["data"])
    assert items == [{"ctx": i["ctx"], "endings": i["endings"], "label": i["label"]} for i in ITEMS]
    assert len(hellaswag.load_items(files["data"], limit=2)) == 2


@pytest.mark.parametrize("line, problem", [
    ("{not json", "malformed HellaSwag line"),
    (json.dumps({"ctx": "a", "endings": ["x", "y", "z"], "label": 0}), "endings is not a list of 4 strings"),
    (json.dumps({"ctx": "a", "endings": ["w", "x", "y", "z"], "label": 4}), "label 4 is not 0-3"),
    (json.dumps({"endings": ["w", "x", "y", "z"], "label": 1}), "no ctx string"),
    ("[1, 2]", "not an object"),
])
def test_malformed_line_names_the_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ITEMS[0]) + "\n" + line + "\n")
    with pytest.raises(common.UserError, match=f"line 2: .*{problem}"):
        hellaswag.load_items(str(path))


def test_download_once_and_offline_error(tmp_path, monkeypatch):
    payload = "".join(json.dumps(item) + "\n" for item in ITEMS).encode()
    calls = []

    class Response:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return payload

    def fake_urlopen(url, timeout):
        calls.append(url)
        return Response()

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    monkeypatch.setenv("HELLASWAG_CACHE", str(tmp_path / "cache"))
    assert len(hellaswag.load_items()) == len(ITEMS)
    assert len(hellaswag.load_items(limit=3)) == 3
    assert calls == [hellaswag.HELLASWAG_URL]  # fetched once, then read from the cache
    assert os.path.isfile(tmp_path / "cache" / hellaswag.HELLASWAG_FILE)

    def offline(url, timeout):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(common.UserError, match="--data-file"):
        hellaswag.load_items(cache_dir=str(tmp_path / "elsewhere"))


def test_download_official_file(tmp_path, github_online):
    items = hellaswag.load_items(cache_dir=str(tmp_path))
    assert len(items) == hellaswag.HELLASWAG_VAL_ITEMS


# ----------------------------------------------------------------------------------------------
# Command line


def cli_error(argv, capsys):
    """Run the CLI in-process as `python hellaswag.py` would; return its one error line."""
    with pytest.raises(SystemExit) as e:
        common.run_main(lambda: hellaswag.main(argv))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_cli_json(model, files, capsys):
    hellaswag.main(["--model", files["ckpt"], "--data-file", files["data"], "--json", "--device", "cpu",
                    "--batch-size", "3"])
    out, err = capsys.readouterr()
    result = json.loads(out)  # stdout holds the JSON line alone
    assert {k: result[k] for k in ("acc", "acc_norm", "n")} == hellaswag.evaluate(model, ITEMS, "cpu")
    assert "acc_norm" in err  # the human summary


def test_cli_malformed_line_no_traceback(files, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ITEMS[0]) + "\n{oops\n")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "hellaswag.py"), "--model", files["ckpt"],
                           "--data-file", str(bad)], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "line 2" in proc.stderr


def test_cli_bad_models(files, tmp_path, capsys):
    truncated = tmp_path / "ckpt_000002.pt"
    truncated.write_bytes(open(files["ckpt"], "rb").read()[:1000])
    assert "truncated" in cli_error(["--model", str(truncated), "--data-file", files["data"]], capsys)
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    assert "not a checkpoint written by train_gpt2.py" in cli_error(["--model", str(foreign), "--data-file",
                                                                     files["data"]], capsys)
    assert "not found" in cli_error(["--model", "no/such/model.pt", "--data-file", files["data"]], capsys)
    assert "--limit" in cli_error(["--model", files["ckpt"], "--data-file", files["data"], "--limit", "0"], capsys)
    assert "does not exist" in cli_error(["--model", files["ckpt"], "--data-file", "nope.jsonl"], capsys)


def test_cli_unknown_hub_name(files, capsys, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail at once, no network retries
    assert "no-such-gpt2-model" in cli_error(["--model", "no-such-gpt2-model", "--data-file", files["data"]], capsys)
