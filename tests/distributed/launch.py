"""Run a function on N gloo ranks in spawned processes, with a hard timeout.

``launch(world_size, fn, config)`` starts ``world_size`` processes (spawn), each
initialising a gloo group on a free 127.0.0.1 port and calling
``fn(rank, world_size, config)``; it returns the ranks' results (anything
torch.save can store). A rank that raises makes the launch fail with its traceback;
a rank still alive after ``timeout`` seconds is terminated and the launch fails, so a
hang fails the test instead of blocking it.
"""

from __future__ import annotations

import gc
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, config, out: str) -> None:
    torch.set_num_threads(1)
    path = Path(out)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        try:
            result = fn(rank, world_size, config)
            dist.barrier()
        finally:
            # reference cycles that still hold the group (sharded modules, their planners)
            # are freed now, so that gloo's threads end while the interpreter is alive: a
            # thread still running at its exit can abort the process ("terminate called
            # without an active exception"; examples/fsdp_train.py)
            gc.collect()
            dist.destroy_process_group()
        torch.save(result, path / f"{rank}.pt")
    except BaseException:
        (path / f"{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None


def launch(world_size: int, fn: Callable, config=None, timeout: float = 120.0) -> list:
    """Each rank's ``fn(rank, world_size, config)``, in rank order (see module doc)."""
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [
            context.Process(target=_entry, args=(rank, world_size, port, fn, config, out))
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        errors = [
            (Path(out) / f"{rank}.err").read_text()
            for rank in range(world_size)
            if (Path(out) / f"{rank}.err").exists()
        ]
        if errors:
            raise AssertionError("a rank failed:\n" + "\n".join(errors))
        if hung:
            raise AssertionError(f"ranks {hung} still running after {timeout} s: terminated")
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise AssertionError(
                f"ranks {failed} exited with {[procs[r].exitcode for r in failed]}"
            )
        return [
            torch.load(Path(out) / f"{rank}.pt", weights_only=False) for rank in range(world_size)
        ]


__all__ = ["free_port", "launch"]
