"""
train_gpt2.py with one fault injected, for the tests that check how a run survives it; the trainer
itself carries no test hook. Run it as the trainer (python or torchrun), with FAULT set to
KIND:RANK:STEP: that rank sends itself the signal as the optimizer step STEP begins (its
train_step call, after the loop has read its stop flag), in the first launch only (not after a
torchrun restart).
    kill   SIGKILL: the process dies at once (a lost worker)
    term   SIGTERM: a stop request that arrives while the step runs
"""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import parallel  # noqa: E402
import train_gpt2  # noqa: E402

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}


def inject(spec):
    kind, rank, step = spec.split(":")
    real_step, calls = train_gpt2.train_step, []

    def faulty(model, optimizer, scaler, loader, grad_accum, ranks, *args, **kwargs):
        if ranks.rank == int(rank) and len(calls) == int(step) and parallel.torchrun_restart() == 0:
            os.kill(os.getpid(), SIGNALS[kind])
        calls.append(1)
        return real_step(model, optimizer, scaler, loader, grad_accum, ranks, *args, **kwargs)
    train_gpt2.train_step = faulty


if __name__ == "__main__":
    inject(os.environ["FAULT"])
    common.run_main(train_gpt2.main)
