"""Tools and an environment for the multi-turn GRPO tests (tests/test_grpo_tools.py), written as TRL 1.16's docs
write them (type hints and a Google-style docstring): they run unchanged under `--tools` and
`--environment_factory`."""

import sys
import time

from PIL import Image


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def crop(left: int, top: int) -> list:
    """
    Crops a 32x32 region of the image and returns it with a caption.

    Args:
        left: The left edge of the region.
        top: The top edge of the region.

    Returns:
        The region as an image, and a caption.
    """
    region = Image.new("RGB", (32, 32), (200, 30, 30) if left < 16 else (30, 30, 200))
    return [{"type": "image", "image": region}, {"type": "text", "text": f"region at {left},{top}"}]


def broken(kind: str) -> str:
    """
    Fails in the way it is asked to.

    Args:
        kind: raise, exit, hang, none, object or image.
    """
    if kind == "raise":
        raise RuntimeError("the tool broke")
    if kind == "exit":
        sys.exit(3)
    if kind == "hang":
        time.sleep(60)
    if kind == "image":
        return [{"type": "image", "image": "not an image"}]
    return None if kind == "none" else object()


class CounterEnv:
    """One instance per completion: a counter the model increments."""

    def reset(self, **kwargs) -> str | None:
        self.counter = 0

    def increment(self, step: int) -> int:
        """
        Increments the counter.

        Args:
            step: How much to add.

        Returns:
            The counter after the increment.
        """
        self.counter += step
        return self.counter


class ObservedCounterEnv(CounterEnv):
    """A counter that greets the model (TRL: what reset returns is appended to the last user turn) and scores the
    completion by how far it counted (`get_reward`)."""

    def reset(self, **kwargs) -> str | None:
        super().reset(**kwargs)
        return "The counter starts at zero."

    def get_reward(self) -> float:
        if self.counter > 100:
            raise RuntimeError("counted too far")
        return float(self.counter)


def sandboxed(seconds: float) -> str:
    """
    Runs as code-execution sandboxes do: manages SIGALRM itself (ignores it, cancels the timer), then blocks.

    Args:
        seconds: How long it blocks.
    """
    import signal

    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    signal.setitimer(signal.ITIMER_REAL, 0)
    time.sleep(seconds)
    return "done"


async def doubled(a: int) -> int:
    """
    Doubles an integer, awaiting as a network tool would.

    Args:
        a: The integer.
    """
    import asyncio

    await asyncio.sleep(0)
    return 2 * a


def hostile(kind: str):
    """
    Returns or raises what a hostile tool may.

    Args:
        kind: empty, placeholder, cancelled, deep, transparent or huge.
    """
    import asyncio

    import numpy as np

    if kind == "cancelled":
        raise asyncio.CancelledError("the task was cancelled")
    if kind == "empty":  # a crop of an empty box
        return [{"type": "image", "image": Image.new("RGB", (32, 32)).crop((5, 5, 5, 20))}]
    if kind == "placeholder":
        return "the region shows <image> and <|image_pad|>"
    if kind == "deep":  # a 16-bit greyscale image: a depth map
        return [{"type": "image", "image": Image.fromarray(np.full((8, 8), 1000, dtype=np.uint16))}]
    if kind == "transparent":
        return [{"type": "image", "image": Image.new("RGBA", (8, 8), (200, 0, 0, 0))}]
    return "x" * 10_000_000


def make_counter() -> CounterEnv:
    """A function as the factory (TRL: any callable that returns an environment)."""
    return CounterEnv()


class BlockingEnv(CounterEnv):
    """An environment whose reset blocks."""

    def reset(self, **kwargs) -> str | None:
        time.sleep(60)


class FloodingEnv(CounterEnv):
    """An environment whose reset returns 100 KB of text."""

    def reset(self, **kwargs) -> str | None:
        super().reset(**kwargs)
        return "word " * 20_000


class ShadowingEnv(CounterEnv):
    """An environment with a method named as a standalone tool is."""

    def multiply(self, a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a * b


class ZoomFailingWhereAsked:
    """The zoom task's environment, whose tool fails on rows with `fail_zoom` set (a failure on the ranks that hold
    such rows only); the same schema as ZoomEnv's."""

    def __init__(self):
        from mmrecipes.vlm.algorithms.zoom import ZoomEnv

        self.inner = ZoomEnv()

    def reset(self, fail_zoom=False, **row) -> None:
        self.fail = fail_zoom
        return self.inner.reset(**row)

    def zoom(self, quadrant: str) -> list:
        """
        Zooms in.

        Args:
            quadrant: top-left, top-right, bottom-left or bottom-right
        """
        if self.fail:
            raise RuntimeError("the zoom failed on this row")
        return self.inner.zoom(quadrant)
