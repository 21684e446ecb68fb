"""
train_gpt2.py instrumented for the tests that check how a run survives a fault or what it
compiles; the trainer itself carries no test hook. Run it as the trainer (python or torchrun),
with any of these set:
  FAULT=KIND:RANK:STEP     that rank sends itself the signal as the optimizer step STEP begins (its
                           train_step call, after the loop has read its stop flag), in the first
                           launch only (not after a torchrun restart)
        kill   SIGKILL: the process dies at once (a lost worker)
        term   SIGTERM: a stop request that arrives while the step runs
        raise  an error; destroying the process group then waits until the timeout, as NCCL's
               finalize can for the ranks that wait for the failed one
        evalterm   SIGTERM during the STEP-th validation (0-based), once its first batch is read
        slowsay    (STEP 0) a rank that meets an error is held 3 s between posting its line and reading
                   the others', as a loaded machine can hold it
  COMPILE_BACKEND=NAME     torch.compile uses this Dynamo backend (aot_eager: inductor's graphs
                           without a C++ build on a small CPU)
  COMPILE_LOG=PATH         each rank appends one JSON line to PATH.rankN per evaluation at the top of
                           a step: {"step", "graphs"}, the graphs Dynamo compiled during it
"""
import functools
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import common  # noqa: E402
import evaluation  # noqa: E402
import parallel  # noqa: E402
import train_gpt2  # noqa: E402

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}


def inject(spec):
    kind, rank, step = spec.split(":")
    if kind == "evalterm":
        return inject_in_validation(int(rank), int(step))
    if kind == "slowsay":
        return hold_in_comparing(int(rank))
    real_step, calls = train_gpt2.train_step, []

    def faulty(parts, *args, **kwargs):
        if len(calls) == int(step) and parallel.torchrun_restart() == 0:
            fault(kind, parts.ranks.rank == int(rank))
        calls.append(1)
        return real_step(parts, *args, **kwargs)
    train_gpt2.train_step = faulty


def inject_in_validation(rank, nth):
    real, calls = evaluation.validation_loss, []

    def validation_loss(model, loader, sequences, ranks, *args):
        here = len(calls) == nth and ranks.rank == rank and parallel.torchrun_restart() == 0
        calls.append(1)
        if here:
            next_batch = loader.next_batch

            def first_batch(*a, **k):
                loader.next_batch = next_batch
                batch = next_batch(*a, **k)
                os.kill(os.getpid(), signal.SIGTERM)
                return batch
            loader.next_batch = first_batch
        return real(model, loader, sequences, ranks, *args)
    evaluation.validation_loss = validation_loss


def hold_in_comparing(rank):
    real = common.wait_for

    def wait_for(store, keys, *args):
        if int(os.environ.get("RANK", "0")) == rank and keys[0] == "error/0":  # the ranks' lines, just posted
            time.sleep(3)
        return real(store, keys, *args)
    common.wait_for = wait_for


def fault(kind, here):
    if kind == "raise":
        group = torch.distributed.new_group()  # made by every rank (a collective)
        if here:
            # a collective no other rank joins, which destroying the process group waits for (gloo's
            # does not wait; NCCL's finalize can, for the ranks that wait for this one)
            pending = torch.distributed.all_reduce(torch.zeros(1), group=group, async_op=True)
            destroy = torch.distributed.destroy_process_group
            torch.distributed.destroy_process_group = lambda: (pending.wait(), destroy())
            raise RuntimeError("fault injected")
    elif here:
        os.kill(os.getpid(), SIGNALS[kind])


def count_compiles(backend, log_path):
    """torch.compile with `backend`, counting the graphs it is handed; with log_path, the count of
    each evaluation is written down."""
    from torch._dynamo.backends.registry import lookup_backend
    real_backend, graphs = lookup_backend(backend), [0]

    def counting(gm, example_inputs):
        graphs[0] += 1
        return real_backend(gm, example_inputs)
    torch.compile = functools.partial(torch.compile, backend=counting)
    if not log_path:
        return
    real_evaluate = evaluation.evaluate

    def evaluate(evaluations, step, max_steps, stop):
        before = graphs[0]
        result = real_evaluate(evaluations, step, max_steps, stop)
        with open(f"{log_path}.rank{evaluations.ctx.ranks.rank}", "a") as f:
            f.write(json.dumps({"step": step, "graphs": graphs[0] - before}) + "\n")
        return result
    evaluation.evaluate = evaluate


if __name__ == "__main__":
    if os.environ.get("FAULT"):
        inject(os.environ["FAULT"])
    if os.environ.get("COMPILE_BACKEND"):
        count_compiles(os.environ["COMPILE_BACKEND"], os.environ.get("COMPILE_LOG"))
    common.run_main(train_gpt2.main)
