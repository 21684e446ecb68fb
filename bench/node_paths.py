"""
A node's paths on the GPUs at hand (one is enough), each against one process: the steps two_ranks, fsdp,
activation_checkpointing and peer of bench/device_check.py. Each is a few launches of the real scripts into
OUT/<step>*; it prints its figure last, on a line that starts with its name and ' | ', and exits 1 where what it
checks does not hold.

    python bench/node_paths.py two_ranks --data-dir DIR --out OUT                 # on the GPU
    python bench/node_paths.py fsdp --data-dir DIR --out OUT --device cpu --small  # the same, tiny, on a CPU

  two_ranks  torchrun with 2 processes on one GPU over gloo (--dist-backend gloo; NCCL refuses two ranks on one
             device): DDP with compile, accumulation under no_sync, clipping, the step's all-reduce and validation's,
             a checkpoint at step 4 and a resume from it; its losses against one process on the same batches
             (float32, as the CPU tests compare them)
  fsdp       --sharding fsdp in one process (a group of one, NCCL on CUDA): per-block compile, the device's 16-bit
             compute with fp32 reduction, Muon, the full checkpoint and an exact resume from it, the Hugging Face
             export; then two ranks of it where there are 2 GPUs (on a CPU the suite holds FSDP over two ranks to
             one process), and gloo's collectives on this device one by one (gloo_collectives)
  activation_checkpointing   the default recipe with --activation-checkpointing, at the micro-batch the recipe
             chose without it: tokens/s and peak memory against that run (OUT/run, the train step's, where there is
             one; else a launch of its own)
  peer       build-nanogpt's own train_gpt2.py (--peer-src: fetched by you, never part of this project) run by the
             peer script on the same shards, in turns with ours on its shapes (B=64, T=1024): both median tokens/s
  gloo_collectives   (under torchrun) the collectives FSDP2 and DDP issue, over gloo on this device, each checked
             for its result: which gloo carries here
"""

import argparse
import json
import os
import shutil
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import UserError  # noqa: E402
from device_check import (LOSS_TOLERANCE, PY, SMALL, first_line, last_line, run_logged, same_losses,  # noqa: E402
                          trainer_flags)
from metrics import read_metrics  # noqa: E402

TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
NODE = dict(n_layer=4, n_head=4, n_embd=256, block_size=256)  # the GPU's model for the paths: small, quick to compile
SAME = 1e-5  # relative: the precision the CPU tests hold runs of the same batches to (tests/test_train.py)
# on CUDA, TF32 matmuls, the compiled graph split at DDP's buckets and attention's atomic backward round otherwise
SAME_CUDA = 1e-4
PEER_SHAPES = dict(micro_batch_size=64, block_size=1024, total_batch_size=524288)  # build-nanogpt's B, T and batch
PEER_SMALL = dict(n_layer=2, n_head=2, n_embd=64, micro_batch_size=4, block_size=64, total_batch_size=512,
                  compile=False)  # the peer script's --small: B=4, T=64, 2 accumulation steps
PEER_SKIP = 5  # both sides' medians of tokens/s from this step on: compile and warm-up left out
PEER_WARMUP, PEER_SMALL_WARMUP, PEER_LR = 715, 2, 6e-4  # its warm-up (--small: as the peer script patches it), peak


def peer_schedule(steps, small):
    """Our flags for the peer's learning rate at each of `steps` steps: its warm-up, where the run is shorter than
    it, is ours stretched to the run's end with the peak scaled down to the rate the peer reaches there."""
    warmup = PEER_SMALL_WARMUP if small else PEER_WARMUP
    if warmup <= steps:
        return dict(warmup_steps=warmup)
    return dict(warmup_steps=steps, max_lr=PEER_LR * steps / warmup)


def launch(name, cmd, out, timeout=None):
    """Run cmd, its output into OUT/name.launch.log (OUT/name.log is device_check's log of the whole step) and a
    trainer's run into OUT/name, made anew; its exit status, or "timeout" (killed with what it started)."""
    shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    print(f"-- {name}: {' '.join(cmd)}", flush=True)
    return run_logged(cmd, output(out, name), timeout=timeout)


def output(out, name):
    return os.path.join(out, f"{name}.launch.log")


def losses_within(a, b, out, tolerance, what):
    """(phrase, ok): how far run b's losses are from run a's (both under out), against tolerance."""
    worst = same_losses(os.path.join(out, a), os.path.join(out, b))[1]
    if worst is None:
        return f"{what}: no losses to compare", False
    return f"{what}: losses within {worst:.1e}{'' if worst <= tolerance else f' (over {tolerance:g})'}", \
        worst <= tolerance


def resumed_within(a, b, out, tolerance, what):
    """losses_within for a resume (run b from run a's checkpoint): its first step's loss must be a's exactly (the
    same weights, data and graph), the later ones within tolerance."""
    phrase, ok = losses_within(a, b, out, tolerance, what)
    try:
        first, later = ({r["step"]: r["loss"] for r in read_metrics(os.path.join(out, d))["train"]} for d in (a, b))
    except UserError:
        return phrase, False
    step = min(later, default=None)
    if step is None or later[step] != first.get(step):
        return f"{phrase}; step {step}'s loss is not the first run's", False
    return f"{phrase}, step {step} equal", ok


def report(name, parts, ok):
    print(f"{name} | " + "; ".join(parts), flush=True)
    return 0 if ok else 1


def two_ranks(a):
    tolerance = SAME_CUDA if a.device.startswith("cuda") else SAME
    shape = SMALL if a.small else NODE
    micro = 2 if a.small else 8
    settings = dict(shape, total_batch_size=2 * micro * shape["block_size"] * 2,  # 2 ranks x 2 accumulation steps
                    micro_batch_size=micro, max_steps=8, checkpoint_every=4, eval_every=4, dtype="float32")
    settings.update(val_tokens=4 * settings["total_batch_size"])
    codes = [launch("two_ranks", TORCHRUN + ["train_gpt2.py"] + trainer_flags(a, a.out, "two_ranks", **settings)
                    + ["--dist-backend", "gloo"], a.out)]
    codes.append(launch("two_ranks_resume", TORCHRUN + [  # the run's settings, gloo among them, from its checkpoint
        "train_gpt2.py", "--log-dir", os.path.join(a.out, "two_ranks_resume"),
        "--resume", os.path.join(a.out, "two_ranks", "ckpt_000004.pt")], a.out))
    codes.append(launch("two_ranks_one", [PY, "train_gpt2.py"] + trainer_flags(a, a.out, "two_ranks_one", **settings),
                        a.out))  # one process, 4 accumulation steps: the same batches
    same, same_ok = losses_within("two_ranks_one", "two_ranks", a.out, tolerance, "against one process")
    resumed, resumed_ok = resumed_within("two_ranks", "two_ranks_resume", a.out, tolerance, "resumed at step 4")
    shared = first_line(output(a.out, "two_ranks"), "warning: 2 processes share")
    return report("two_ranks", [f"exit {codes}", same, resumed] + (["GPU shared (the header warns)"] if shared else []),
                  codes == [0, 0, 0] and same_ok and resumed_ok)


def fsdp(a):
    import torch
    cuda = a.device.startswith("cuda")
    shape = SMALL if a.small else dict(NODE, total_batch_size=64 * NODE["block_size"])
    settings = dict(shape, max_steps=8, checkpoint_every=4, eval_every=4, val_tokens=4 * shape["block_size"],
                    sharding="fsdp", optimizer="muon")
    codes = [launch("fsdp", [PY, "train_gpt2.py"] + trainer_flags(a, a.out, "fsdp", **settings, export_hf=True),
                    a.out)]
    codes.append(launch("fsdp_resume", [PY, "train_gpt2.py", "--log-dir", os.path.join(a.out, "fsdp_resume"),
                                         "--resume", os.path.join(a.out, "fsdp", "ckpt_000004.pt")], a.out))
    resumed, ok = resumed_within("fsdp", "fsdp_resume", a.out, SAME_CUDA if cuda else SAME,
                                 "world 1, resumed at step 4")
    exported = os.path.isfile(os.path.join(a.out, "fsdp", "hf", "model.safetensors"))
    warned = bool(first_line(output(a.out, "fsdp"), "warning: --sharding fsdp with one"))
    parts = [resumed, "exported" if exported else "no export"] + ([] if warned else ["no one-process warning"])
    ok = ok and exported and warned
    print(f"fsdp | exit {codes}; " + "; ".join(parts), flush=True)  # before the probe, which may hang or crash
    if cuda and torch.cuda.device_count() >= 2:  # two ranks, where there are two GPUs
        codes.append(launch("fsdp_two", TORCHRUN + ["train_gpt2.py"] + trainer_flags(a, a.out, "fsdp_two", **settings),
                            a.out))
        phrase, two_ok = losses_within("fsdp", "fsdp_two", a.out, LOSS_TOLERANCE, "2 ranks against world 1")
        parts.append(phrase)
        ok = ok and two_ok
    probe = launch("fsdp_gloo", TORCHRUN + [os.path.join("bench", "node_paths.py"), "gloo_collectives",
                                            "--device", a.device], a.out, timeout=60)
    carried = last_line(output(a.out, "fsdp_gloo"), "gloo_collectives |").partition(" | ")[2]
    parts.append(f"{carried or f'gloo on {a.device}: no answer'} (exit {probe})")
    return report("fsdp", [f"exit {codes}"] + parts, ok and codes == [0] * len(codes))


def gloo_collectives(a):
    """Under torchrun: each collective FSDP2 and DDP issue, over gloo on a.device, checked for its result, in order;
    rank 0 prints which passed as it goes (a crash in one, such as a segfault, leaves those before it printed)."""
    import torch
    import torch.distributed as tdist
    import parallel
    ranks = parallel.setup_distributed(a.device, 120, "gloo")
    dev, world, me = ranks.device, ranks.world_size, ranks.rank
    done = []

    def check(name, fn):
        try:
            ok = bool(fn())
            if dev.startswith("cuda"):
                torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001
            ok = f"failed ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"
        done.append(f"{name} {'ok' if ok is True else ok if ok else 'wrong result'}")
        if ranks.is_master:
            print(f"gloo_collectives | gloo on {ranks.device_type}: " + ", ".join(done), flush=True)

    def all_reduce(dtype, op, expected):
        t = torch.full((4,), me + 1, dtype=dtype, device=dev)
        tdist.all_reduce(t, op=op)
        return bool((t == expected).all())

    def gathered():
        out = torch.empty(world * 4, device=dev)
        tdist.all_gather_into_tensor(out, torch.full((4,), float(me), device=dev))
        return torch.equal(out.cpu(), torch.arange(world).float().repeat_interleave(4))

    def scattered():
        out = torch.empty(4, device=dev)
        tdist.reduce_scatter_tensor(out, torch.ones(world * 4, device=dev), op=tdist.ReduceOp.AVG)
        return bool((out == 1).all())

    def broadcast():
        t = torch.full((4,), float(me), device=dev)
        tdist.broadcast(t, 0)
        return bool((t == 0).all())

    def full_tensor():  # a DTensor's gather: FSDP2's full checkpoints, its export and Muon
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(ranks.device_type, (world,))
        whole = torch.arange(world * 4, dtype=torch.float32, device=dev)
        return torch.equal(distribute_tensor(whole, mesh, [Shard(0)]).full_tensor().cpu(), whole.cpu())

    def fully_shard_step():
        from torch.distributed.fsdp import fully_shard
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).to(dev)
        fully_shard(net)
        net(torch.ones(2, 8, device=dev)).sum().backward()
        return all(p.grad is not None for p in net.parameters())

    check("all_reduce sum float32", lambda: all_reduce(torch.float32, tdist.ReduceOp.SUM, world * (world + 1) / 2))
    check("all_reduce min int64", lambda: all_reduce(torch.int64, tdist.ReduceOp.MIN, 1))
    check("broadcast", broadcast)
    check("all_gather_into_tensor", gathered)
    check("reduce_scatter_tensor avg", scattered)
    check("fully_shard forward and backward", fully_shard_step)
    check("DTensor.full_tensor", full_tensor)
    parallel.teardown_distributed()
    return 0


def metrics_figures(log_dir, skip=3):
    """(micro-batch, median tok/s from step `skip` on, peak memory in GiB or None) of a trainer's run, or None."""
    try:
        m = read_metrics(log_dir)
    except UserError:
        return None
    run = next((launch["run"] for launch in m["launches"] if launch["run"]), {})
    steady = [r for r in m["train"] if r["step"] >= skip]
    peaks = [r["peak_mem"] for r in m["train"] if r.get("peak_mem") is not None]
    return (run.get("config", {}).get("micro_batch_size"),
            statistics.median(r["tok_per_s"] for r in steady) if steady else None,
            max(peaks) / 2 ** 30 if peaks else None)


def figures_text(figures):
    if figures is None:
        return "no run"
    micro, tok, peak = figures
    return (f"micro-batch {micro}, {f'{tok:,.0f}' if tok else '?'} tok/s, "
            f"peak {f'{peak:.1f} GiB' if peak is not None else 'n/a (CUDA only)'}")


def activation_checkpointing(a):
    without = os.path.join(a.out, "run")  # the train step's: the default recipe
    off = metrics_figures(without)
    if off is None:
        launch("activation_checkpointing_off", [PY, "train_gpt2.py"] + trainer_flags(
            a, a.out, "activation_checkpointing_off"), a.out)
        without = os.path.join(a.out, "activation_checkpointing_off")
        off = metrics_figures(without)
    # at the micro-batch the recipe chose without it: what checkpointing alone saves and costs
    code = launch("activation_checkpointing", [PY, "train_gpt2.py"] + trainer_flags(
        a, a.out, "activation_checkpointing", activation_checkpointing=True,
        micro_batch_size=off[0] if off else None), a.out)
    on = metrics_figures(os.path.join(a.out, "activation_checkpointing"))
    ratio = f" ({on[1] / off[1]:.2f}x)" if on and off and on[1] and off[1] else ""
    return report("activation_checkpointing", [f"on: {figures_text(on)}{ratio}",
                                                f"off ({os.path.basename(without)}): {figures_text(off)}"],
                  code == 0 and on is not None)


def peer(a):
    if not a.peer_src or not os.path.isfile(a.peer_src):
        return report("peer", [f"no build-nanogpt train_gpt2.py at --peer-src {a.peer_src}"], False)
    script = a.peer_script or os.path.join(os.path.dirname(os.path.abspath(a.peer_src)), "build_nanogpt_speed.py")
    if not os.path.isfile(script):
        return report("peer", [f"no peer script at {script}: copy ../shared/peers/build_nanogpt_speed.py there"],
                      False)
    shapes = dict(PEER_SMALL if a.small else PEER_SHAPES)
    peer_cmd = [PY, script, "--src", os.path.abspath(a.peer_src), "--data-dir", os.path.abspath(a.data_dir),
                "--steps", str(a.steps), "--skip", str(PEER_SKIP), "--workdir", os.path.join(a.out, "peer_work")]
    peer_cmd += ["--small"] if a.small else []
    peers, ours, codes, gaps = [], [], [], []
    for turn in range(a.repeats):  # in turns: the peer, then ours
        codes.append(launch(f"peer_{turn}", peer_cmd, a.out))
        last = open(output(a.out, f"peer_{turn}")).read().strip().splitlines()[-1:] or ["{}"]
        try:
            result = json.loads(last[0])
        except ValueError:
            result = {}
        peers.append(result.get("tok_per_s"))
        name = f"peer_ours_{turn}"
        log_dir = os.path.join(a.out, name)
        codes.append(launch(name, [PY, "train_gpt2.py"] + trainer_flags(
            a, a.out, name, max_steps=a.steps, checkpoint_every=0, **shapes, **peer_schedule(a.steps, a.small)),
            a.out))
        ours.append((metrics_figures(log_dir, skip=PEER_SKIP) or (None, None, None))[1])  # the peer's steps
        gaps.append(loss_gap(result.get("steps", []), log_dir))
    peer_tok, our_tok = [t for t in peers if t], [t for t in ours if t]
    if not peer_tok or not our_tok:
        return report("peer", [f"exit {codes}", f"build-nanogpt {peers}", f"ours {ours}"], False)
    p, o = statistics.median(peer_tok), statistics.median(our_tok)
    gap = max((g for g in gaps if g is not None), default=None)
    return report("peer", [f"build-nanogpt {p:,.0f} tok/s", f"ours {o:,.0f} tok/s", f"ours/peer {o / p:.2f}x",
                           f"{a.repeats} turn(s) of {a.steps} steps, medians of steps {PEER_SKIP}+",
                           "losses " + (f"within {gap:.1e} of the peer's (it leaves the padded columns unmasked)"
                                        if gap is not None else "not compared")], codes == [0] * len(codes))


def loss_gap(peer_steps, log_dir):
    """The largest relative gap between the peer's step losses and ours, or None."""
    try:
        ours = {r["step"]: r["loss"] for r in read_metrics(log_dir)["train"]}
    except UserError:
        return None
    gaps = [abs(s["loss"] - ours[s["step"]]) / abs(ours[s["step"]]) for s in peer_steps if s["step"] in ours]
    return max(gaps, default=None)


STEPS = {"two_ranks": two_ranks, "fsdp": fsdp, "gloo_collectives": gloo_collectives,
         "activation_checkpointing": activation_checkpointing, "peer": peer}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("--data-dir", help="token shards from fineweb.py")
    p.add_argument("--out", default="device_check", help="results folder (default: device_check)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="a tiny model: the same launches on a CPU")
    p.add_argument("--peer-src", help="build-nanogpt's train_gpt2.py (peer)")
    p.add_argument("--peer-script", help="the peer script (default: build_nanogpt_speed.py beside --peer-src)")
    p.add_argument("--steps", type=int, default=20, help="steps of each peer launch (default 20)")
    p.add_argument("--repeats", type=int, default=1, help="turns of the peer and ours (default 1)")
    a = p.parse_args(argv)
    if a.step != "gloo_collectives":
        if not a.data_dir:
            p.error("--data-dir is required")
        a.out = os.path.abspath(a.out)
        os.makedirs(a.out, exist_ok=True)
    return a


if __name__ == "__main__":
    args = parse_args()
    sys.exit(STEPS[args.step](args))
