"""Two gloo ranks on this machine, started once for a test module, that run the scenarios its tests hand them. A
scenario is a function of the test module, called on both ranks as fn(ranks, tmp, *args) (tmp holds tiny.py's shard
in tmp/data); the test gets both ranks' results, or fails with the error a rank raised. So each scenario sits beside
the test that reads it, and a broken one fails its own test alone (the pair starts again for the next). A result is
kept for the other tests that read the same scenario: starting processes is the slow part, and no run is repeated."""
import datetime
import importlib
import io
import os
import traceback

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

import processes

TIMEOUT_S = 300  # a scenario's limit on a busy machine; a collective one rank never joins fails in 60 s (below)


def serve(rank, world, rendezvous, tmp, conn):
    """One rank: join the group, then run each scenario sent until None comes."""
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                             timeout=datetime.timedelta(seconds=60))
    import parallel
    ranks = parallel.Ranks(rank, rank, world, "cpu")
    while (job := conn.recv()) is not None:
        module, name, args = job
        try:
            result = ("ok", getattr(importlib.import_module(module), name)(ranks, tmp, *args))
        except Exception:  # noqa: BLE001 (the test that sent it fails with it; the pair starts again)
            result = ("error", traceback.format_exc())
        buf = io.BytesIO()
        torch.save(result, buf)
        conn.send_bytes(buf.getvalue())
    tdist.destroy_process_group()
    os._exit(0)  # skip the interpreter's shutdown, where gloo's threads can abort the process (common.exit_process)


class Pair:
    def __init__(self, tmp):
        self.tmp, self.results, self.procs, self.starts = tmp, {}, [], 0

    def __call__(self, scenario, *args):
        """[rank 0's result, rank 1's] of scenario(ranks, tmp, *args)."""
        key = (scenario.__module__, scenario.__name__, args)
        if key not in self.results:
            self.results[key] = self._run(key)
        failed = [f"rank {r}: {value}" for r, (status, value) in enumerate(self.results[key]) if status != "ok"]
        if failed:
            pytest.fail(f"scenario {scenario.__name__}{args} failed\n" + "\n".join(failed))
        return [value for _, value in self.results[key]]

    def _run(self, job):
        if not self.procs:
            self._start()
        for conn, _ in self.procs:
            conn.send(job)
        results = []
        for conn, _ in self.procs:
            if not conn.poll(TIMEOUT_S):
                self.close()
                return [("error", f"no result within {TIMEOUT_S} s")] * 2
            results.append(torch.load(io.BytesIO(conn.recv_bytes()), weights_only=False))
        if any(status != "ok" for status, _ in results):
            self.close()  # its group may be left waiting on a collective: the next scenario gets a new pair
        return results

    def _start(self):
        ctx = mp.get_context("spawn")  # a fresh interpreter: a fork would inherit the test process's thread pools
        self.starts += 1
        rendezvous = os.path.join(self.tmp, f"rendezvous{self.starts}")
        for rank in range(2):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(rank, 2, rendezvous, self.tmp, theirs), daemon=True)
            with processes.kept("a module's pair of ranks (tests/pair.py)"):
                proc.start()
            theirs.close()
            self.procs.append((mine, proc))

    def close(self):
        for conn, _ in self.procs:
            try:
                conn.send(None)
            except OSError:
                pass
        for _, proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs = []
