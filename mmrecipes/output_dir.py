"""One run per output directory: a lock file naming its owner, taken before anything is written.

Two runs writing one `output_dir` destroy each other's work (the second removes the first one's
checkpoint in progress as a save that did not finish). The run's main process creates
`<output_dir>/.mmrecipes.lock` with `O_EXCL` (atomic on local and network filesystems), under an
flock on the directory (so that checking a stale lock and taking it over is one step between
processes), holding its host, pid, process start time and Slurm job id, and keeps the file's time
fresh from a background thread. Another run is refused, naming the owner. A lock is stale, and taken
over with a line in the log, when its process is gone: on the same host the pid no longer runs the
process that wrote it; from another host (a requeued job on other nodes) it belongs to the same
Slurm job, or it has not been refreshed for `STALE_AFTER_S`. The lock goes when the process exits
(`release_held`: what a process that calls a recipe's `main` more than once calls between runs).
Creating it also proves the directory writable, before the first step rather than at the first save.
"""

import atexit
import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

LOCK_NAME = ".mmrecipes.lock"
REFRESH_S = 30
STALE_AFTER_S = 300
_HELD: list["OutputDirLock"] = []  # locks this process holds, released at exit


def release_held():
    """Release every lock this process holds (at exit, or after an in-process run of a recipe's
    main)."""
    while _HELD:
        _HELD[-1].release()


atexit.register(release_held)


class OutputDirBusy(RuntimeError):
    """Another live run owns the output directory, or it cannot be written."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart); None if it is
    gone or a zombie (killed, not yet reaped: where PID 1 does not reap, as in many containers, that
    can last)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _runs(pid, start_time) -> bool:
    """Whether the process that wrote a lock still runs on this host."""
    if not Path("/proc/self/stat").exists():  # no procfs: the pid alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True
    return start_time is not None and _start_time(pid) == start_time


@contextlib.contextmanager
def _exclusive(directory: Path):
    """Held by one process at a time (an flock on the directory, dropped by the kernel if the
    process dies): the check of a lock and its takeover happen as one step, so two runs never both
    hold it."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # a filesystem without flock: O_EXCL alone, as before
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


class OutputDirLock:
    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_NAME
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": _start_time(os.getpid()),
                      "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
        self.held, self._stop = False, threading.Event()

    def acquire(self) -> str | None:
        """Take the lock; a line for the log when a stale lock was taken over. Raises
        OutputDirBusy."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise OutputDirBusy(f"--output_dir {self.path.parent} cannot be created ({error}): choose a writable "
                                "directory") from None
        # two runs that find the same stale lock take it over one after the other
        with _exclusive(self.path.parent):
            return self._acquire()

    def _acquire(self) -> str | None:
        note = None
        for _ in range(3):
            try:
                descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner, stale = self._read_owner()
                if not stale:
                    raise OutputDirBusy(
                        f"--output_dir {self.path.parent} is in use by pid {owner.get('pid')} on {owner.get('host')} "
                        f"(lock {self.path}, refreshed {self._age():.0f} s ago). Two runs in one output_dir remove "
                        "each other's checkpoints: wait for it, pick another --output_dir, or delete the lock file "
                        "if that run is gone.") from None
                if owner.get("pid") != self.owner["pid"] or owner.get("host") != self.owner["host"]:
                    note = (f"took over {self.path}: its run (pid {owner.get('pid')} on {owner.get('host')}) is gone "
                            f"({stale})")
                self.path.unlink(missing_ok=True)
                continue
            except OSError as error:
                raise OutputDirBusy(f"--output_dir {self.path.parent} is not writable ({error}): the run would train "
                                    "and then fail at its first save. Choose a writable directory.") from None
            try:
                with os.fdopen(descriptor, "w") as file:
                    json.dump(self.owner, file)
            except OSError as error:  # a full disk: no lock left behind without its owner
                self.path.unlink(missing_ok=True)
                raise OutputDirBusy(f"--output_dir {self.path.parent} cannot be written ({error}): free space or "
                                    "choose another directory") from None
            self.held = True
            _HELD.append(self)
            threading.Thread(target=self._refresh, daemon=True, name="output-dir-lock").start()
            return note
        raise OutputDirBusy(f"{self.path}: another run keeps taking this output_dir; pick another --output_dir")

    def _age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except OSError:
            return 0.0

    def _read_owner(self) -> tuple[dict, str | None]:
        """(owner, why it is stale or None)."""
        try:
            owner = json.loads(self.path.read_text())
        except (OSError, ValueError):
            owner = {}
        if not owner:  # being written right now, or its writer died before it wrote its owner
            return owner, "it names no owner" if self._age() >= REFRESH_S else None
        if owner.get("host") == self.owner["host"] and isinstance(owner.get("pid"), int):
            if owner["pid"] == self.owner["pid"]:
                return owner, "this process took it before"  # main() called again in one process
            if _runs(owner["pid"], owner.get("start_time")):
                return owner, None
            return owner, "its process no longer runs"
        if owner.get("slurm_job_id") and owner["slurm_job_id"] == self.owner["slurm_job_id"]:
            return owner, f"the same Slurm job {owner['slurm_job_id']}, requeued"
        if self._age() > STALE_AFTER_S:
            return owner, f"not refreshed for {self._age():.0f} s"
        return owner, None

    def _refresh(self):
        while not self._stop.wait(REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self):
        if self.held:
            self._stop.set()
            self.held = False
            _HELD.remove(self)
            self.path.unlink(missing_ok=True)
