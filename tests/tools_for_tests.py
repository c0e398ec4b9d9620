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
