"""hellaswag.py on a tiny random GPT: scores against a plain re-computation of the definition,
batched against one item at a time, the split across 2 gloo ranks, data loading and bad input."""

import io
import json
import os
import sys
import time
import urllib.request
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import common  # noqa: E402
from common import UserError  # noqa: E402
import checkpoint  # noqa: E402
import parallel  # noqa: E402
import scoring  # noqa: E402
import tokenizer  # noqa: E402
import hellaswag  # noqa: E402

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


def evaluate(model, items, device, should_stop=None, **how):
    """hellaswag.py's evaluation of items: scoring.evaluate over hellaswag.HellaSwag, scored as how says (Scoring's
    fields)."""
    return scoring.evaluate(model, hellaswag.HellaSwag(items), scoring.Scoring(device, **how), should_stop)


@pytest.fixture(scope="module")
def files(tmp_path_factory, model):
    d = tmp_path_factory.mktemp("hellaswag")
    data = d / "hellaswag_val.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS), encoding="utf-8")
    ckpt = d / "ckpt_000001.pt"
    checkpoint.save_file(str(ckpt), {"model_config": asdict(model.config), "model": model.state_dict()})
    return {"data": str(data), "ckpt": str(ckpt), "dir": d}


def reference(model, items):
    """The definition, one ending at a time: context + " " + ending, cross-entropy over the ending."""
    enc = tokenizer.get_tokenizer()
    sums, means = [], []
    for item in items:
        ctx = enc.encode(item["ctx"]) or [tokenizer.EOT_TOKEN]  # an empty context: <|endoftext|>
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


def scores(model, items, batch_size=4):
    """Each ending's summed loss and token count, (n, 4) float64 each: the scores of the rows that
    evaluate renders."""
    share = scoring.share_of(hellaswag.HellaSwag(items), model.config.block_size)
    *_, (sums, counts, _) = scoring.scored_batches(model, share.rows, "cpu", batch_size=batch_size)
    return sums.view(-1, 4), counts.view(-1, 4)


@torch.no_grad()
def test_scores_match_reference(model):
    sums_ref, means_ref = reference(model, ITEMS)
    sums, counts = scores(model, ITEMS, batch_size=3)
    torch.testing.assert_close(sums, sums_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sums / counts, means_ref, rtol=1e-5, atol=1e-4)
    labels = torch.tensor([item["label"] for item in ITEMS])
    result = evaluate(model, ITEMS, "cpu", batch_size=3)
    assert result == {"acc": (sums_ref.argmin(1) == labels).double().mean().item(),
                      "acc_norm": (means_ref.argmin(1) == labels).double().mean().item(), "n": len(ITEMS)}


@torch.no_grad()
def test_batched_equals_one_at_a_time(model):
    one = scores(model, ITEMS, batch_size=1)
    for batch_size in (2, 16):  # 7 items: a short last batch, and one batch larger than the set
        sums, counts = scores(model, ITEMS, batch_size=batch_size)
        torch.testing.assert_close(sums, one[0], rtol=1e-5, atol=1e-4)
        assert torch.equal(counts, one[1])
    assert evaluate(model, ITEMS, "cpu", batch_size=1) == evaluate(model, ITEMS, "cpu")


def test_context_longer_than_block_size_is_cut_from_the_front(model):
    enc = tokenizer.get_tokenizer()
    item = {"ctx": "word " * 100, "endings": ["one two three", "four", "five six", "seven"], "label": 0}
    ctx, endings = hellaswag.render(item, enc, model.config.block_size)
    assert endings == [enc.encode(" " + e) for e in item["endings"]]  # endings whole
    assert len(ctx) + max(len(e) for e in endings) == 64  # the longest row just fits
    assert ctx == enc.encode(item["ctx"])[-len(ctx):]  # the end of the context is kept
    sums, counts = scores(model, [item])
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
    tokens, pos, seg, where = scoring.pack(ctx, [([], e) for e in endings])
    assert pos == [0, 1, 2, 3, 4, 3, 3, 4, 5, 3]
    assert seg == [0, 0, 0, 1, 1, 2, 3, 3, 3, 4]
    assert where == [2, 3, 2, 2, 6, 7, 2]  # the context's last token predicts each ending's first
    seg_t = torch.tensor([seg + [-1, -1]])  # two padding tokens
    mask = scoring.attention_mask(seg_t)
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
        assert evaluate(compiled, ITEMS, "cpu", batch_size=3) == evaluate(model, ITEMS, "cpu")
        assert model.training  # restored
    finally:
        model.eval()
    assert not model.training


def test_shares_cover_every_item_once():
    for n in (0, 1, 7, 10):
        for world in (1, 2, 3):
            bench = SimpleNamespace(items=list(range(n)), rows=lambda item, block_size: [])
            got = [i for r in range(world) for i in scoring.share_of(bench, 64, r, world).items]
            assert sorted(got) == list(range(n))


def rank_worker(rank, world_size, port, ckpt, data, out):
    """One of 2 ranks: gloo on loopback, set up by parallel.setup_distributed as under torchrun."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    ranks = parallel.setup_distributed("cpu", timeout_s=120)  # a collective the other rank never joins fails soon
    seen = []  # the items this rank renders: those it scores
    render = hellaswag.render

    def recording(item, *args):
        seen.append(item["ctx"])
        return render(item, *args)

    hellaswag.render = recording
    model, _ = checkpoint.load_model(ckpt, "cpu")
    items = hellaswag.load_items(data)
    result = evaluate(model, items, "cpu", batch_size=2, rank=ranks.rank, world_size=ranks.world_size)
    seen_before_stops = list(seen)

    def collective_stop(asked_at):
        """The trainer's kind of should_stop: any rank's request, all-reduced (a collective)."""
        calls = []

        def should_stop():
            calls.append(1)
            flag = torch.tensor([1 if rank == 1 and len(calls) == asked_at else 0])
            torch.distributed.all_reduce(flag)
            return bool(flag.item())
        return should_stop, calls

    # batch_size 1: rank 0 holds 4 items, rank 1 holds 3, yet both must call should_stop 4 times
    stops = []
    for asked_at in (None, 2):  # never; rank 1 asks before the 2nd batch
        should_stop, calls = collective_stop(asked_at)
        outcome = evaluate(model, items, "cpu", batch_size=1, rank=ranks.rank, world_size=ranks.world_size,
                           should_stop=should_stop)
        stops.append({"calls": len(calls), "result": outcome})
    # the benchmark in the loop, its data missing on rank 1 alone: off on both ranks, no collective left waiting
    lines = []

    def load():
        if rank == 1:
            raise UserError("HellaSwag file /data/hs.jsonl does not exist")
        return hellaswag.HellaSwag(items)
    hook = scoring.TrainingHook("hellaswag", load, ranks, SimpleNamespace(line=lines.append), lockstep=False)
    hooked = [hook(model, "float32", lambda: False) for _ in range(2)]  # loaded at the first call; then still off
    parallel.teardown_distributed()
    with open(f"{out}{rank}.json", "w") as f:
        json.dump({"seen": seen_before_stops, "result": result, "stops": stops, "hooked": hooked, "lines": lines}, f)


def test_two_gloo_ranks_split_reduce_and_stop(model, files, tmp_path, free_port):
    import torch.multiprocessing as mp
    port = free_port
    out = str(tmp_path / "rank")
    # fork: the children start at once, without importing torch again (spawn elsewhere)
    method = "fork" if sys.platform == "linux" else "spawn"
    ctx = mp.start_processes(rank_worker, args=(2, port, files["ckpt"], files["data"], out), nprocs=2,
                             join=False, start_method=method)
    deadline = time.time() + 600  # bounds a hang only
    while not ctx.join(timeout=1):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the 2 gloo ranks did not finish within 120 s")
    ranks = [json.load(open(f"{out}{r}.json")) for r in range(2)]
    seen = ranks[0]["seen"] + ranks[1]["seen"]
    assert sorted(seen) == sorted(item["ctx"] for item in ITEMS)  # every item once, none twice
    assert len(ranks[0]["seen"]) == 4 and len(ranks[1]["seen"]) == 3
    assert ranks[0]["result"] == ranks[1]["result"] == evaluate(model, ITEMS, "cpu")
    # a collective should_stop: no hang with shares of 4 and 3 items, and a stop on one rank stops both
    for r in ranks:
        assert r["stops"] == [{"calls": 4, "result": ranks[0]["result"]}, {"calls": 2, "result": None}]
    # a scored benchmark whose data one rank lacks is off on every rank, each saying why it is
    assert ranks[0]["hooked"] == ranks[1]["hooked"] == [None, None]
    assert ranks[0]["lines"] == ["hellaswag: skipped for this run (data missing on another rank)"]
    assert ranks[1]["lines"] == ["hellaswag: skipped for this run (HellaSwag file /data/hs.jsonl does not exist)"]


class StopAfter:
    """A should_stop that answers True from its k-th call on (never, for k=None), counting calls."""

    def __init__(self, k=None):
        self.k, self.calls = k, 0

    def __call__(self):
        self.calls += 1
        return self.k is not None and self.calls >= self.k


def test_should_stop_ends_evaluation_at_once(model):
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    model.train()
    try:
        stop = StopAfter(2)
        assert evaluate(model, ITEMS, "cpu", batch_size=2, should_stop=stop) is None
        assert stop.calls == 2 and len(forwards) == 1  # asked before each batch: one of 4 batches ran
        assert model.training  # restored on the early return too
        never = StopAfter()
        forwards.clear()
        assert evaluate(model, ITEMS, "cpu", batch_size=2, should_stop=never) == \
            evaluate(model, ITEMS, "cpu", batch_size=2)
        assert never.calls == 4 == len(forwards) / 2
    finally:
        hook.remove()
        model.eval()


@pytest.mark.parametrize("n, world_size, batch_size", [(7, 2, 1), (5, 2, 2), (7, 3, 2), (1, 2, 2), (2, 3, 1)])
def test_should_stop_called_as_often_on_every_rank(model, n, world_size, batch_size):
    """should_stop may be an all-reduce, which hangs unless every rank calls it as often, though
    ranks hold different numbers of items (here one more, or none at all). Without
    torch.distributed initialised, each rank's evaluate scores its share alone."""
    calls, scored = [], 0
    for rank in range(world_size):
        stop = StopAfter()
        scored += evaluate(model, ITEMS[:n], "cpu", batch_size=batch_size, rank=rank, world_size=world_size,
                           should_stop=stop)["n"]
        calls.append(stop.calls)
    assert scored == n
    longest_share = -(-n // world_size)
    assert calls == [-(-longest_share // batch_size)] * world_size


# ----------------------------------------------------------------------------------------------
# Data


def test_load_items(files):
    items = hellaswag.load_items(files["data"])
    assert items == [{"ctx": i["ctx"], "endings": i["endings"], "label": i["label"]} for i in ITEMS]
    assert len(hellaswag.load_items(files["data"], limit=2)) == 2


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not JSON"),
    ("ctx,endings,label", "not JSON"),  # a CSV export
    ("[1, 2]", "not an object"),
    (json.dumps(ITEMS[0])[:60], "not complete JSON: the line ends before its value does (cut short?)"),  # in a string
    ('{"ctx": "a", "endings": ["w", "x"', "not complete JSON: the line ends before its value does"),
    (json.dumps({"endings": ["w", "x", "y", "z"], "label": 1}), "no 'ctx'"),
    (json.dumps({"ctx": 3, "endings": ["w", "x", "y", "z"], "label": 1}), "'ctx' is not a string"),
    (json.dumps({"ctx": "a", "label": 1}), "no 'endings'"),
    (json.dumps({"ctx": "a", "endings": "wxyz", "label": 1}), "'endings' is not a list of strings"),
    (json.dumps({"ctx": "a", "endings": ["x", "y", "z"], "label": 0}), "3 endings, not 4"),
    (json.dumps({"ctx": "a", "endings": ["v", "w", "x", "y", "z"], "label": 0}), "5 endings, not 4"),
    (json.dumps({"ctx": "a", "endings": ["w", "x", "y", "z"]}), "no 'label'"),
    (json.dumps({"ctx": "a", "endings": ["w", "x", "y", "z"], "label": 4}), "label 4 is not 0-3"),
    (json.dumps({"ctx": "a", "endings": ["w", "x", "y", "z"], "label": -1}), "label -1 is not 0-3"),
    (json.dumps({"ctx": "a", "endings": ["w", "x", "y", "z"], "label": "b"}), "label 'b' is not 0-3"),
    (json.dumps({"ctx": "a", "endings": ["w", "x", "y", "z"], "label": True}), "label True is not 0-3"),
    (json.dumps({"ctx": "a", "endings": ["", " ", "", ""], "label": 2}), "every ending is empty: nothing to score"),
])
def test_malformed_line_names_the_file_and_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ITEMS[0]) + "\n\n" + line + "\n" + json.dumps(ITEMS[1]) + "\n")
    with pytest.raises(common.UserError) as e:
        hellaswag.load_items(str(path))
    assert str(e.value).startswith(f"{path} line 3: malformed HellaSwag line") and problem in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_file(tmp_path, text):
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    with pytest.raises(common.UserError, match=f"{path} holds no HellaSwag items.*leave out --data-file"):
        hellaswag.load_items(str(path))
    with pytest.raises(common.UserError, match="leave out --hellaswag-file to download"):  # the trainer's flag
        hellaswag.load_items(str(path), flag="--hellaswag-file")


@pytest.mark.parametrize("kind", ["gzip", "lzma", "bz2"])
def test_compressed_file_is_read(tmp_path, kind):
    """A .jsonl.gz (or .xz, .bz2) copy reads as the plain file does; a damaged one is one line that says
    it is compressed, not "not JSON"."""
    import importlib
    module = importlib.import_module(kind)
    plain = "".join(json.dumps(item) + "\n" for item in ITEMS).encode()
    path = tmp_path / f"hellaswag_val.jsonl.{kind}"
    path.write_bytes(module.compress(plain))
    plain_path = tmp_path / "hellaswag_val.jsonl"
    plain_path.write_bytes(plain)
    assert hellaswag.load_items(str(path)) == hellaswag.load_items(str(plain_path))
    path.write_bytes(module.compress(plain)[:40])
    name = {"gzip": "gzip", "lzma": "xz", "bz2": "bz2"}[kind]
    with pytest.raises(common.UserError, match=f"cannot read {name}-compressed HellaSwag file {path}"):
        hellaswag.load_items(str(path))


def test_string_labels_are_read(tmp_path):
    path = tmp_path / "labels.jsonl"
    path.write_text(json.dumps(dict(ITEMS[0], label="2")) + "\n")
    assert hellaswag.load_items(str(path))[0]["label"] == 2


def test_download_once_and_offline_error(tmp_path, monkeypatch):
    payload = "".join(json.dumps(item) + "\n" for item in ITEMS).encode()
    calls = []

    def fake_urlopen(url, timeout):
        calls.append(url)
        return io.BytesIO(payload)

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    monkeypatch.setattr(common, "unreachable", lambda url, timeout: None)  # as if online
    monkeypatch.setenv("HELLASWAG_CACHE", str(tmp_path / "cache"))
    assert len(hellaswag.load_items()) == len(ITEMS)
    assert len(hellaswag.load_items(limit=3)) == 3
    assert calls == [hellaswag.HELLASWAG_URL]  # fetched once, then read from the cache
    assert os.path.isfile(tmp_path / "cache" / hellaswag.HELLASWAG_FILE)

    def offline(url, timeout):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(common.UserError, match="--data-file path/to/hellaswag_val.jsonl"):
        hellaswag.load_items(cache_dir=str(tmp_path / "elsewhere"))


def no_network(monkeypatch):
    """The download URL on a local port nothing serves, no proxy, and urlopen failing the test
    if it is called anyway: a machine without network, answered without waiting."""
    monkeypatch.setattr(hellaswag, "HELLASWAG_URL", "http://127.0.0.1:9/hellaswag_val.jsonl")
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)

    def urlopen(*args, **kwargs):
        raise AssertionError("urlopen called although the host is unreachable")
    monkeypatch.setattr(urllib.request, "urlopen", urlopen)


def test_offline_without_data_file_is_one_line(files, tmp_path, monkeypatch, capsys):
    no_network(monkeypatch)
    monkeypatch.setenv("HELLASWAG_CACHE", str(tmp_path / "cache"))
    err = cli_error(["--model", files["ckpt"], "--device", "cpu"], capsys)
    assert "--data-file path/to/hellaswag_val.jsonl" in err and "127.0.0.1 cannot be reached" in err
    assert not (tmp_path / "cache").exists()  # nothing written
    # inside train_gpt2.py the local copy is given with --hellaswag-file, and the error says so
    with pytest.raises(common.UserError, match="--hellaswag-file path/to/hellaswag_val.jsonl"):
        hellaswag.load_items(None, flag="--hellaswag-file")


def test_offline_with_the_file_cached(model, files, tmp_path, monkeypatch, capsys):
    no_network(monkeypatch)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / hellaswag.HELLASWAG_FILE).write_text(open(files["data"], encoding="utf-8").read(), encoding="utf-8")
    hellaswag.main(["--model", files["ckpt"], "--cache-dir", str(cache), "--json", "--device", "cpu",
                    "--limit", "3"])
    assert json.loads(capsys.readouterr().out)["n"] == 3


def test_download_official_file(tmp_path, github_online):
    items = hellaswag.load_items(cache_dir=str(tmp_path))
    assert len(items) == 10042  # the validation split


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
    assert {k: result[k] for k in ("acc", "acc_norm", "n")} == evaluate(model, ITEMS, "cpu")
    assert "acc_norm" in err  # the human summary


def test_cli_malformed_line_is_one_line(files, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ITEMS[0]) + "\n{oops\n")
    assert "line 2" in cli_error(["--model", files["ckpt"], "--data-file", str(bad)], capsys)


def test_cli_closed_stdout_ends_quietly(files):
    """python hellaswag.py ... | head, head gone: exit status 1, no traceback."""
    from runs import stdout_closed
    code, err = stdout_closed(os.path.join(REPO, "hellaswag.py"), ["--model", files["ckpt"],
                                                                   "--data-file", files["data"],
                                                                   "--device", "cpu", "--limit", "2"])
    assert code == 1 and "Traceback" not in err and "Error" not in err, err


@pytest.mark.parametrize("script", ["hellaswag", "core"])
def test_cli_compile_on_a_gpu_without_triton_is_one_line(files, tmp_path, monkeypatch, capsys, script):
    """--compile on a GPU below compute capability 7.0 (a P100): the trainer's one line, before the
    data or the model is loaded, not inductor's traceback at the first forward pass."""
    import core
    from core_bundle import write_bundle
    from test_device import fake_gpus
    fake_gpus(monkeypatch, [("Tesla P100-PCIE-16GB", (6, 0))])
    main, data = ((hellaswag.main, ["--data-file", files["data"]]) if script == "hellaswag"
                  else (core.main, ["--bundle-dir", write_bundle(tmp_path / "bundle")]))
    with pytest.raises(SystemExit) as e:
        common.run_main(lambda: main(["--model", files["ckpt"], "--device", "cuda", "--compile"] + data))
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: --compile: the Tesla P100-PCIE-16GB has compute capability 6.0") and "7.0" in err


def test_cli_bad_models(files, tmp_path, capsys):
    truncated = tmp_path / "ckpt_000002.pt"
    truncated.write_bytes(open(files["ckpt"], "rb").read()[:1000])
    assert "truncated" in cli_error(["--model", str(truncated), "--data-file", files["data"]], capsys)
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    assert "not a checkpoint written by train_gpt2.py" in cli_error(["--model", str(foreign), "--data-file",
                                                                     files["data"]], capsys)
    assert "not found" in cli_error(["--model", "no/such/model.pt", "--data-file", files["data"]], capsys)
    missing = str(tmp_path / "no_such_dir")
    assert f"model {missing!r} not found" in cli_error(["--model", missing, "--data-file", files["data"]], capsys)
    (tmp_path / "empty_log").mkdir()
    assert "has no ckpt_*.pt checkpoint" in cli_error(["--model", str(tmp_path / "empty_log"), "--data-file",
                                                       files["data"]], capsys)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a checkpoint" * 50)
    assert "is not a checkpoint: not a torch zip or pickle file" in cli_error(["--model", str(garbage), "--data-file",
                                                                               files["data"]], capsys)
    assert "does not exist" in cli_error(["--model", files["ckpt"], "--data-file", "nope.jsonl"], capsys)
    assert "is a directory" in cli_error(["--model", files["ckpt"], "--data-file", str(tmp_path)], capsys)


@pytest.mark.parametrize("flags, needle", [
    (["--limit", "0"], "--limit must be at least 1, got 0"),
    (["--limit", "-5"], "--limit must be at least 1, got -5"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--batch-size", "-2"], "--batch-size must be at least 1, got -2"),
    (["--limit", "all"], "error: argument --limit: invalid int value: 'all' (see --help)"),
    (["--compile", "yes"], "error: unrecognized arguments: yes (see --help)"),
])
def test_cli_bad_numbers(files, capsys, flags, needle):
    assert needle in cli_error(["--model", files["ckpt"], "--data-file", files["data"]] + flags, capsys)


def test_cli_unknown_hub_name(files, capsys, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail at once, no network retries
    assert "no-such-gpt2-model" in cli_error(["--model", "no-such-gpt2-model", "--data-file", files["data"]], capsys)
