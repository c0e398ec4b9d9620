"""Run a measurement in a fresh spawned process, so each variant's peak memory is its own."""

import os

import torch.multiprocessing as mp


class _Answer:
    def put(self, value):
        self.value = value


def run_in_fresh_process(function, *args, fresh=True):
    """`function(*args, queue)` in a new process; returns what it put on the queue. `fresh=False` (the --quick
    smoke runs, whose numbers nobody reads): in this process, without the seconds a spawn's imports cost."""
    if not fresh:
        answer = _Answer()
        function(*args, answer)
        return answer.value
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=function, args=(*args, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def resident_bytes() -> int:
    """The process's resident set now (CPU memory held)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
