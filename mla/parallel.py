"""Tensor parallelism over heads: start N processes on this machine, one process group.

    from mla import parallel

    def work(rank, world_size, group, seed):                  # runs in every process
        full = mla.MLAWeights(config, seed=seed)               # the same weights everywhere
        attn = mla.build(full.shard(rank, world_size), "absorbed", process_group=group)
        ...                                                    # same x and lengths on every rank
        return small_picklable_result

    results = parallel.launch(work, 2, seed)                   # [rank 0's result, rank 1's]

Each rank holds h / N heads (`MLAWeights.shard`) and the whole latent cache: every rank computes
and caches the same c + r values a token, then its heads' attention and its slice of o_proj; the
tier all-reduces the partial outputs over `group` (`MLAAttention.reduce_and_bias`) once a call.
Every rank must therefore get the same x and lengths and make the same calls in the same order:
a collective that one rank reaches and another skips blocks both until the group's timeout.

Backends: gloo on the CPU, NCCL with one GPU a rank (rank k uses cuda:k). The group is set up
over TCP on a free localhost port. NVLink multicast (NVLS) is turned off for NCCL, symmetric
memory and NVSHMEM, in this process and in the children (see `DISABLE_MULTICAST`).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

# Set before any process group is made, in every process: the GPU machines this project runs on
# are to be used with NVLink multicast (NVLS) off; plain NVLink and PCIe paths are unaffected.
DISABLE_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def disable_multicast(env: dict[str, str] | None = None) -> dict[str, str]:
    """Write DISABLE_MULTICAST into `env` (default: os.environ) and return it.

    For a program started with an environment of its own, pass that environment:
    `subprocess.run(cmd, env=disable_multicast(dict(os.environ)))`.
    """
    env = os.environ if env is None else env
    env.update(DISABLE_MULTICAST)
    return env


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_for(rank: int, backend: str) -> torch.device:
    """The device rank `rank` computes on: the CPU under gloo, cuda:rank under NCCL."""
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
           timeout_s: float = 300.0) -> list[Any]:
    """Run `fn(rank, world_size, group, *args)` in `world_size` new processes; their results.

    Args:
        fn: a module-level function (spawned processes import it by name). `group` is the
            process group of all ranks; under NCCL the rank's GPU is already current.
        world_size: processes to start, >= 1.
        args: passed on to every rank; picklable.
        backend: "gloo" (CPU) or "nccl" (one GPU a rank: needs world_size visible GPUs).
        timeout_s: a collective that waits longer than this fails instead of hanging.

    Returns:
        [fn's return value on rank 0, on rank 1, ...]. Keep them small and plain (numbers,
        lists, strings): they travel back through a pipe. A rank that raises makes `launch`
        raise RuntimeError with that rank's traceback (the first rank to fail: the others then
        fail in their collectives) and the other ranks are ended.

    A rank leaves with `os._exit` once its result is sent, without the interpreter's teardown:
    a multiprocessing lock or semaphore that `fn` makes (tqdm's default lock, for one) is then
    reported as leaked at exit; give such code a thread lock instead.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"NCCL with {world_size} ranks needs {world_size} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    disable_multicast()  # spawned children inherit os.environ; _rank sets it again
    queue = mp.get_context("spawn").SimpleQueue()
    address = f"tcp://127.0.0.1:{free_port()}"
    context = mp.start_processes(_rank, args=(fn, world_size, address, backend, timeout_s, queue,
                                              args),
                                 nprocs=world_size, join=False, start_method="spawn")
    results: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []  # in the order they happened
    while True:
        # Read results while waiting, so that a rank blocked on a full pipe still gets to exit.
        try:
            done = context.join(timeout=0.05)
        except ProcessException:
            # Once one rank fails the others fail too, in their next collective; the first
            # failure is the cause, whichever process the context noticed first.
            _drain(queue, results, failures)
            if not failures:
                raise
            rank, trace = failures[0]
            raise RuntimeError(f"rank {rank} of {world_size} failed:\n{trace}") from None
        _drain(queue, results, failures)
        if done:
            return [results[rank] for rank in range(world_size)]


def _drain(queue: Any, results: dict[int, Any], failures: list[tuple[int, str]]) -> None:
    while not queue.empty():
        rank, ok, value = queue.get()
        if ok:
            results[rank] = value
        else:
            failures.append((rank, value))


def _rank(rank: int, fn: Callable[..., Any], world_size: int, address: str, backend: str,
          timeout_s: float, queue: Any, args: tuple) -> None:
    """One spawned process: join the group, run fn, send its result to the parent, leave."""
    disable_multicast()
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        value = fn(rank, world_size, dist.group.WORLD, *args)
        dist.barrier()  # no rank leaves (and tears the group down) while another still reduces
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
        raise
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo's worker threads can still be winding down
    # then, and destroying them during finalisation can abort a rank ("terminate called without
    # an active exception", SIGABRT) after its result is sent. What the teardown would flush (a
    # rank's block-buffered prints to a pipe) is flushed here.
    sys.stdout.flush()
    sys.stderr.flush()
    queue.put((rank, True, value))
    os._exit(0)

