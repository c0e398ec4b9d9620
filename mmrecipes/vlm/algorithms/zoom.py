"""The embedded agentic task: a small shape in a large picture, and a tool that zooms into a
quadrant of it.

At the model's input size (the tiny Llava's 32 pixels) the 128-pixel picture shows the shape as a
blob of about 3 pixels: where it is, not what it is. `ZoomEnv.zoom(quadrant)` returns that quadrant
at twice the scale, where the shape is about 6 pixels across. Rows (data_prep/make_zoom.py) carry
the scene as JSON (`scene`), which the environment redraws at `reset`; the question asks which shape
it is.

    accelerate launch recipes/vlm_grpo.py --model_name_or_path embedded:tiny_zoom_vlm \
        --dataset_name embedded:vlm_zoom/prompts --environment_factory
        mmrecipes.vlm.algorithms.zoom:ZoomEnv
"""

import json

from PIL import Image, ImageDraw

CANVAS = 128
SHAPES = ("circle", "square", "triangle")
QUADRANTS = {"top-left": (0, 0), "top-right": (1, 0), "bottom-left": (0, 1), "bottom-right": (1, 1)}
QUESTION = "Which shape is in the picture: circle, square or triangle?"


def draw(scene: dict) -> Image.Image:
    """The picture of a scene: {"background": rgb, "colour": rgb, "shape": one of SHAPES, "x", "y":
    its centre, "half": its half-width}."""
    image = Image.new("RGB", (CANVAS, CANVAS), tuple(scene["background"]))
    x, y, half, colour = scene["x"], scene["y"], scene["half"], tuple(scene["colour"])
    pen = ImageDraw.Draw(image)
    if scene["shape"] == "circle":
        pen.ellipse((x - half, y - half, x + half, y + half), fill=colour)
    elif scene["shape"] == "square":
        pen.rectangle((x - half, y - half, x + half, y + half), fill=colour)
    else:
        pen.polygon([(x, y - half), (x - half, y + half), (x + half, y + half)], fill=colour)
    return image


def quadrant_of(scene: dict) -> str:
    column, row = int(scene["x"] >= CANVAS // 2), int(scene["y"] >= CANVAS // 2)
    return next(name for name, corner in QUADRANTS.items() if corner == (column, row))


def zoomed(image: Image.Image, quadrant: str) -> Image.Image:
    """The quadrant of `image`, at the picture's size (twice the scale)."""
    column, row = QUADRANTS[quadrant]
    half = image.width // 2
    return image.crop((column * half, row * half, (column + 1) * half, (row + 1) * half)).resize(image.size)


class ZoomEnv:
    """One picture per completion (`reset(scene=...)`, TRL's environment API); its tool, `zoom`."""

    def reset(self, scene=None, **row) -> None:
        self.picture = draw(json.loads(scene) if isinstance(scene, str) else scene)

    def zoom(self, quadrant: str) -> list:
        """
        Zooms in.

        Args:
            quadrant: top-left, top-right, bottom-left or bottom-right
        """
        if quadrant not in QUADRANTS:
            raise ValueError(f"no quadrant {quadrant!r}: one of {', '.join(QUADRANTS)}")
        return [{"type": "image", "image": zoomed(self.picture, quadrant)}, {"type": "text", "text": quadrant}]
