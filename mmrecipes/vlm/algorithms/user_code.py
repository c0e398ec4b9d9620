"""User code in a run (GRPO's `--reward_funcs`, `--tools`, `--environment_factory`): imported by
path and run within a time limit, so that nothing it raises, catches or blocks on ends or hangs the
run unnamed. Rewards and tools share these guards.

- `imported(path, flag, seconds, limit_flag)`: what module:name names; the import said before it
  starts (a module that blocks while it is imported leaves no empty log) and timed out naming the
  module and the flag.
- `time_limit(seconds, what, flag, timeout)`: the block raises `timeout` (a `UserCodeTimeout`, named
  for what timed out) after `seconds`, and every second after while it lasts (SIGALRM, the main
  thread only). It is no `Exception`: an `except Exception` in a user's retry loop lets it through.
  `STUCK_S` seconds past the limit a watchdog thread ends the process, naming `what`: code that
  swallows every timeout, ignores SIGALRM or cancels the timer (as code-execution sandboxes do)
  cannot keep the run waiting.
- `awaited(value)`: a coroutine's result (`async def` rewards and tools, as TRL 1.16 awaits them),
  else the value.

What no function in the process can be stopped from is ending the process itself (`os._exit`, a
crash in native code): run such code in a process of its own (docs/grpo.md). Such an end is named,
not prevented: while user code runs, `time_limit` marks it in a file of the rank's own (`Running`),
and a rank whose run then fails (its collective with the gone rank broke) says which rank of its
node ended there, and in what.
"""

import asyncio
import atexit
import contextlib
import importlib
import inspect
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

# how long past its time limit user code that defeats the timeout may run before the process ends
STUCK_S = 30.0


class UserCodeTimeout(BaseException):
    """User code ran past its time limit. A BaseException, as KeyboardInterrupt is: `except
    Exception` in a user's retry loop lets it through."""


class RewardTimeout(UserCodeTimeout):
    """A reward function ran past --reward_timeout."""


class ToolTimeout(UserCodeTimeout):
    """A tool call ran past --tool_timeout."""


class EnvironmentTimeout(UserCodeTimeout):
    """An environment's construction or reset ran past --tool_timeout."""


class ImportTimeout(UserCodeTimeout):
    """A module named by a flag blocked while it was imported."""


class Unscored:
    """What a reward source gives for a completion it could not score, with the reason (an
    environment's get_reward that raised): that completion's reward fails, counted, and the reason
    is said."""

    def __init__(self, why: str):
        self.why = why


def say_once_per_node(line: str):
    """Printed by the node's first process (before the accelerator exists: its launcher's
    LOCAL_RANK)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(line, flush=True)


def imported(path: str, flag: str, seconds: float | None = None, limit_flag: str = "--tool_timeout"):
    """What `path` (module:name) names: a reward function, a tool, an environment class (`flag`: the
    flag that gave it, for the error). Its module's import is said first and timed out after
    `seconds` (`limit_flag`'s), naming it."""
    module, _, name = path.partition(":")
    try:
        if module and module not in sys.modules:
            say_once_per_node(f"importing {module} ({flag} {path})")
        with time_limit(seconds, f"importing {module} ({flag} {path})", limit_flag, ImportTimeout):
            return getattr(importlib.import_module(module), name)
    except ImportTimeout as error:
        raise ValueError(f"{error}: its module blocks while it is imported (a network call or a lock at module "
                         "level?); move that work into the function") from None
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"{flag} {path}: cannot import it ({error}); give module:name") from error


def awaited(value):
    """A coroutine's result (run to its end in an event loop of its own), else `value` itself."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


class Running:
    """What user code each rank of a node runs now: one file per rank (`pid what`, empty between
    calls) in a folder the node's ranks share, named for their launcher's process. A rank that ends
    inside user code leaves its line; a rank whose run then fails reads it (`lost_ranks`, said by
    the exception hook it installs when made)."""

    def __init__(self):
        self.folder = Path(tempfile.gettempdir()) / f"mmrecipes-user-code-{os.getppid()}"
        self.file = self.folder / os.environ.get("RANK", "0")
        self.folder.mkdir(exist_ok=True)
        # a rank that ends inside user code leaves it
        atexit.register(self.file.unlink, missing_ok=True)
        self.previous_hook, sys.excepthook = sys.excepthook, self.name_lost_ranks

    def mark(self, what: str):
        self.file.write_text(f"{os.getpid()} {what}" if what else "")

    def lost_ranks(self, wait_s: float = 2.0) -> list[str]:
        """Each other rank of the node that ended while its marked user code ran; one still alive is
        waited for `wait_s` (its end may reach this rank before the process is gone)."""
        lines, deadline = [], time.monotonic() + wait_s
        for file in sorted(self.folder.glob("*"), key=lambda file: int(file.name)):
            pid, _, what = (file.read_text() if file != self.file else "").partition(" ")
            while what and _alive(int(pid)) and time.monotonic() < deadline:
                time.sleep(0.05)
            if what and not _alive(int(pid)):
                lines.append(f"rank {file.name} ended without a word while it ran user code: {what} (os._exit or a "
                             "crash in native code ends a process before any guard can speak; run such code in a "
                             "process of its own, docs/grpo.md)")
        return lines

    def name_lost_ranks(self, kind, error, traceback):
        for line in self.lost_ranks():
            sys.stderr.write(line + "\n")
        self.previous_hook(kind, error, traceback)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a process ended but not yet reaped by its launcher counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


_running = None  # this rank's `Running`, made at the first user code of a launched rank


@contextlib.contextmanager
def _marked(what: str):
    global _running
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        yield
        return
    _running = _running or Running()
    _running.mark(what)
    try:
        yield
    finally:
        _running.mark("")


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str, flag: str, timeout: type = UserCodeTimeout):
    """Raise `timeout` in the block after `seconds` (`flag`'s), and every second after while it
    lasts (the main thread only: a signal timer); `STUCK_S` seconds past the limit, end the process,
    naming `what` on stderr. `what` is marked as running on this rank meanwhile (`Running`)."""
    with _marked(what):
        with _timed(seconds, what, flag, timeout):
            yield


@contextlib.contextmanager
def _timed(seconds: float | None, what: str, flag: str, timeout: type):
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    deadline = time.monotonic() + seconds

    def expire(signum, frame):
        raise timeout(f"{what} ran past {flag} {seconds:g} s")

    def end_process():  # on a thread of its own: the main thread may never run Python again
        late = time.monotonic() - deadline
        os.write(2, f"{what} ran {late:.0f} s past {flag} {seconds:g} s, catching every timeout raised in it: "
                    "ending the process\n".encode())
        os._exit(1)

    watchdog = threading.Timer(seconds + STUCK_S, end_process)
    watchdog.daemon = True
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
