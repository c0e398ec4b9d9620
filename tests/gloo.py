"""Run a function on W CPU processes joined by a gloo process group (torchtitan-style tests).

The processes fork from the fork server the recipes' DataLoader workers use (mmrecipes.loader), which has
imported torch, transformers and datasets once for the test session: a rank starts in a fraction of a second
instead of importing them again (seconds each on 2 cores).
"""

import os
import random
import signal
import socket
import tempfile
from datetime import timedelta
from multiprocessing import forkserver, resource_tracker
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmrecipes.loader import GROUP_SIGNALS, start_worker_server


def free_port() -> int:
    """A free port below the kernel's ephemeral range. A port bound to 0 comes from that range, where every
    connection's local port comes from too: another worker's gloo ranks took one before rank 0 listened on it
    (EADDRINUSE in a launch, once in a suite run)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    for port in random.SystemRandom().sample(range(max(1024, ephemeral - 12_000), ephemeral), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
            return port
    raise RuntimeError(f"no free port below {ephemeral}")


def settle_forked_process():
    """In a process forked from the fork server: the default handlers of GROUP_SIGNALS, which the server ignores
    (the workers' reason), and DataLoader workers forked from that same server. The process knows its address and
    holds its alive pipe; it has imported the data pipeline already, where a server of the process's own would
    cost seconds to start (tens of seconds a run on 2 cores, with two ranks starting theirs at once)."""
    for sig in GROUP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    forkserver.ensure_running = forkserver._forkserver.ensure_running = resource_tracker.ensure_running


def become_rank(rank, world_size, port):
    """In a process forked from the fork server: the environment torchrun gives a rank (one thread, as its
    OMP_NUM_THREADS=1 default), settled as `settle_forked_process` says."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    settle_forked_process()


def _worker(rank, world_size, port, result_dir, fn, args):
    become_rank(rank, world_size, port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(result_dir, f"{rank}.pt"))
        if dist.is_initialized():
            dist.barrier()  # tear the group down together: a rank gone early can abort a peer's gloo threads
    finally:
        if dist.is_initialized():  # code under test may have ended it (accelerator.end_training)
            dist.destroy_process_group()


def start_rank_server():
    """The fork server, with what a rank imports and builds done once in it (tests/rank_preload.py). Python 3.11's
    server ignores the caller's sys.path, so tests/ reaches it through PYTHONPATH, for its start only."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), saved]))
    try:
        start_worker_server(["mmrecipes.contrastive.data", "mmrecipes.vlm.algorithms.preference",
                             "mmrecipes.vlm.rows.collate", "rank_preload"])
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def run_on_ranks(fn, world_size, *args):
    """`fn(rank, world_size, *args)` on every rank; returns the list of per-rank results.

    `fn` must be importable (a module-level function): the processes come from the fork server.
    """
    start_rank_server()
    with tempfile.TemporaryDirectory() as result_dir:
        try:
            mp.start_processes(_worker, args=(world_size, free_port(), result_dir, fn, args), nprocs=world_size,
                               start_method="forkserver", join=True)
        except mp.ProcessExitedException as error:
            # gloo sometimes aborts a process at exit ("terminate called without an active
            # exception") after every rank has finished and saved its result; anything earlier fails.
            if not (error.signal_name == "SIGABRT" and all(
                    os.path.exists(os.path.join(result_dir, f"{rank}.pt")) for rank in range(world_size))):
                raise
        return [torch.load(os.path.join(result_dir, f"{rank}.pt")) for rank in range(world_size)]



def taken_gradients(model) -> dict:
    """The model's gradients by name, copied, and the model's zeroed: the one-process truth of a split step."""
    truth = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    model.zero_grad()
    return truth


def averaged_difference(model, truth: dict, world_size: int) -> float:
    """The model's gradients averaged over the ranks, as the engines do (a sequence-parallel group's ranks each
    computed the whole sequence's loss, so each shard got its gradient once from every rank's loss), then their largest
    difference to `truth` (`taken_gradients`) relative to its largest gradient."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= world_size
    scale = max(grad.abs().max() for grad in truth.values())
    return (max((param.grad - truth[name]).abs().max() for name, param in model.named_parameters() if name in truth)
            / scale).item()
