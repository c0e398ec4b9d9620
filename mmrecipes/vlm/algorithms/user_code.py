"""User code in a run (GRPO's `--reward_funcs`, `--tools`, `--environment_factory`): imported by path and run within
a time limit, so that nothing it raises, catches or blocks on ends or hangs the run unnamed. Rewards and tools share
these guards.

- `imported(path, flag, seconds, limit_flag)`: what module:name names; the import said before it starts (a module
  that blocks while it is imported leaves no empty log) and timed out naming the module and the flag.
- `time_limit(seconds, what, flag, timeout)`: the block raises `timeout` (a `UserCodeTimeout`, named for what timed
  out) after `seconds`, and every second after while it lasts (SIGALRM, the main thread only). It is no `Exception`:
  an `except Exception` in a user's retry loop lets it through. `STUCK_S` seconds past the limit a watchdog thread
  ends the process, naming `what`: code that swallows every timeout, ignores SIGALRM or cancels the timer (as
  code-execution sandboxes do) cannot keep the run waiting.
- `awaited(value)`: a coroutine's result (`async def` rewards and tools, as TRL 1.16 awaits them), else the value.

What no function in the process can be stopped from is ending the process itself (`os._exit`, a crash): run such
code in a process of its own (docs/grpo.md).
"""

import asyncio
import contextlib
import importlib
import inspect
import os
import signal
import sys
import threading
import time

STUCK_S = 30.0  # how long past its time limit user code that defeats the timeout may run before the process ends


class UserCodeTimeout(BaseException):
    """User code ran past its time limit. A BaseException, as KeyboardInterrupt is: `except Exception` in a user's
    retry loop lets it through."""


class RewardTimeout(UserCodeTimeout):
    """A reward function ran past --reward_timeout."""


class ToolTimeout(UserCodeTimeout):
    """A tool call ran past --tool_timeout."""


class EnvironmentTimeout(UserCodeTimeout):
    """An environment's construction or reset ran past --tool_timeout."""


class ImportTimeout(UserCodeTimeout):
    """A module named by a flag blocked while it was imported."""


class Unscored:
    """What a reward source gives for a completion it could not score, with the reason (an environment's get_reward
    that raised): that completion's reward fails, counted, and the reason is said."""

    def __init__(self, why: str):
        self.why = why


def say_once_per_node(line: str):
    """Printed by the node's first process (before the accelerator exists: its launcher's LOCAL_RANK)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(line, flush=True)


def imported(path: str, flag: str, seconds: float | None = None, limit_flag: str = "--tool_timeout"):
    """What `path` (module:name) names: a reward function, a tool, an environment class (`flag`: the flag that gave
    it, for the error). Its module's import is said first and timed out after `seconds` (`limit_flag`'s), naming
    it."""
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


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str, flag: str, timeout: type = UserCodeTimeout):
    """Raise `timeout` in the block after `seconds` (`flag`'s), and every second after while it lasts (the main
    thread only: a signal timer); `STUCK_S` seconds past the limit, end the process, naming `what` on stderr."""
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
