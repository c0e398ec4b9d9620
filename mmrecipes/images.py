"""Images from whatever a row holds: decoded with limits, converted to RGB, and preprocessed in
stacks.

`decode_image` takes a PIL image, encoded bytes (img2dataset's parquet has a plain binary column),
a `datasets.Image(decode=False)` dict or a path, and never raises: it returns the image, or why
there is none, for the caller to count. It reads the header first and refuses, before decoding, an
image with more pixels than `max_pixels` or a longer side more than `max_aspect_ratio` times its
shorter one (a 1 x 400,000 PNG is 1.6 KB; resized to a 224 px short side it would be 224 x 90
million pixels). A path must be a regular file (a FIFO would block the reader for good). Modes
other than RGB are converted; 16- and 32-bit grey levels are scaled to 8 bits, not clipped (a
16-bit PNG clipped to 8 bits is solid white).
"""

import io
import logging
import math
import os
import random
import stat

import numpy
import torch
import torchvision.transforms.v2.functional as tvF
from PIL import Image
from transformers.image_processing_backends import TorchvisionBackend
from transformers.image_utils import PILImageResampling, pil_torch_interpolation_mapping

logger = logging.getLogger(__name__)

# What a processor is asked for pixels that cross the loader as uint8 (a quarter of float32's bytes through shared
# memory, pinning and the copy to the device), and the batch keys that carry the constants finishing them there.
UINT8_PIXELS = {"do_rescale": False, "do_normalize": False}
NORMALIZED_BY = {"pixel_values": "pixel_normalization", "pixel_values_videos": "clip_normalization"}
# What collators add beside the model's inputs: the log's counts, DPO's pair keys, the pixels' constants
HOST_KEYS = ("num_samples", "num_tokens", "target_tokens", "data_counts", "pair_keys", *NORMALIZED_BY.values())


def decode_image(raw_image, max_pixels: int, max_aspect_ratio: float = float("inf")):
    """(RGB image or None, problem or None); problem is "converted", "undecodable" or
    "too_large"."""
    try:
        raw_image = readable_source(raw_image)  # an Image passes through
        if raw_image is None:
            return None, "undecodable"
        image = raw_image if isinstance(raw_image, Image.Image) else Image.open(raw_image)
        width, height = image.size  # header only: nothing decoded yet
        # nothing to see (a crop of an empty box): processors divide by its size
        if not width or not height:
            return None, "undecodable"
        if width * height > max_pixels or max(width, height) > max_aspect_ratio * max(1, min(width, height)):
            return None, "too_large"
        image.load()
    except Image.DecompressionBombError:  # PIL refuses at open() beyond twice its own pixel limit
        return None, "too_large"
    except Exception as error:  # missing files; PIL raises many types for corrupt or truncated ones
        logger.debug("undecodable image: %s", error)
        return None, "undecodable"
    if image.mode == "RGB":
        return image, None
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background, "converted"
    if image.mode.startswith(("I", "F")):
        return _eight_bit_grey(image).convert("RGB"), "converted"
    return image.convert("RGB"), "converted"  # L, P, CMYK, YCbCr, 1, ...


def readable_source(raw):
    """What a decoder opens, from encoded bytes, a `{"bytes", "path"}` dict or a path; None for a
    path that is not a regular file (a directory, FIFO or device: opening a FIFO blocks); anything
    else (an open file, a PIL image) as it is. A missing path raises."""
    if isinstance(raw, dict):
        raw = raw.get("bytes") or raw.get("path")
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return io.BytesIO(raw)
    if isinstance(raw, (str, os.PathLike)) and not stat.S_ISREG(os.stat(raw).st_mode):
        return None
    return raw


def _eight_bit_grey(image: Image.Image) -> Image.Image:
    """An "I;16*", "I" or "F" image as 8-bit grey, its range scaled: 16-bit (and "I" beyond 255) by
    1/257, floats in 0..1 by 255."""
    values = numpy.asarray(image).astype(numpy.float64)
    if image.mode.startswith("I;16") or (image.mode == "I" and values.max(initial=0) > 255):
        values = values / 257
    elif image.mode == "F" and values.max(initial=0) <= 1:
        values = values * 255
    return Image.fromarray(numpy.clip(numpy.rint(values), 0, 255).astype(numpy.uint8), mode="L")


def processed_pixels(image_processor, images: list[Image.Image], normalize: bool = True) -> torch.Tensor:
    """`image_processor(images)["pixel_values"]` for RGB images, computed a size group at a time.

    A processor that runs transformers' standard torchvision pipeline (CLIP, SigLIP, ...) is applied
    as its own resize, center crop and rescale-normalise on one uint8 stack per image size: the same
    operations and output as its __call__, which converts, checks and (on CPU) resizes one image
    at a time, about 4x the time on the embedded images. Any other processor is called as it is.
    `normalize=False`: the standard pipeline stops before rescale-normalise and returns uint8 pixels
    (a quarter of float32's bytes through the loader's shared memory, pinning and the copy to the
    device); `to_device` finishes them on the device (`device_normalization`), to the same floats.
    """
    if not _standard_pipeline_applies(image_processor):
        return image_processor(images=images, return_tensors="pt")["pixel_values"]
    groups = {}
    for index, image in enumerate(images):
        groups.setdefault(image.size, []).append(index)
    pixel_values = [None] * len(images)
    for indices in groups.values():
        stack = torch.from_numpy(numpy.stack([numpy.asarray(images[i]) for i in indices])).permute(0, 3, 1, 2)
        for index, pixels in zip(indices, _standard_pipeline(image_processor, stack, normalize)):
            pixel_values[index] = pixels
    return torch.stack(pixel_values)


def takes_patch_grids(image_processor) -> bool:
    """Whether the processor hands out each image as a variable number of patches with its grid
    (SigLIP 2 NaFlex: `spatial_shapes`, and `pixel_attention_mask` over the padding), not as a
    fixed-size pixel array."""
    return "spatial_shapes" in getattr(image_processor, "model_input_names", ())


def patch_rows(image_processor, images: list[Image.Image]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A NaFlex processor's output per image: its real patches `[h * w, patch values]`, without the
    padding to `max_num_patches` (`padded_patches` pads a batch to its longest image), and its grid
    `(h, w)`."""
    out = image_processor(images=images, return_tensors="pt")
    grids = list(out["spatial_shapes"])
    return [pixels[:int(grid.prod())] for pixels, grid in zip(out["pixel_values"], grids)], grids


def padded_patches(patches: list[torch.Tensor], grids: list[torch.Tensor]) -> dict:
    """NaFlex rows as the model takes a batch: `pixel_values` zero-padded to the longest,
    `pixel_attention_mask` (1 on real patches, as the processor's) and `spatial_shapes`."""
    longest = max(len(rows) for rows in patches)
    pixel_values = patches[0].new_zeros(len(patches), longest, patches[0].shape[-1])
    mask = torch.zeros(len(patches), longest, dtype=torch.int32)
    for index, rows in enumerate(patches):
        pixel_values[index, :len(rows)] = rows
        mask[index, :len(rows)] = 1
    return {"pixel_values": pixel_values, "pixel_attention_mask": mask, "spatial_shapes": torch.stack(grids)}


def image_inputs(image_processor, images: list[Image.Image]) -> dict:
    """A batch of RGB images as the model's image inputs: `pixel_values`, or NaFlex's padded patches
    and grids."""
    if takes_patch_grids(image_processor):
        return padded_patches(*patch_rows(image_processor, images))
    return {"pixel_values": processed_pixels(image_processor, images)}


def random_resized_crops(image_processor, images: list[Image.Image], seeds: list[int], scale=(0.9, 1.0),
                         normalize: bool = True) -> torch.Tensor:
    """open_clip's training transform (its `--aug-cfg` defaults) in the processor's terms: each
    image a random crop of `scale` of its area at an aspect ratio of 3/4 to 4/3 (torchvision's
    RandomResizedCrop sampling), resized with the processor's resample to the size its eval
    transform gives (its crop size, or its size), then rescaled and normalised as its pipeline does
    (`normalize=False`: uint8, as `processed_pixels`). Each crop is drawn from its row's own seed,
    so a resumed stream crops every row as the straight run did."""
    if not _standard_pipeline_applies(image_processor):
        raise ValueError(f"--train_augment crops with the standard resize and crop pipeline, which "
                         f"{type(image_processor).__name__} does not run: drop --train_augment")
    target = image_processor.crop_size if image_processor.do_center_crop else image_processor.size
    size = [target["height"], target["width"]]
    resample = image_processor.resample
    interpolation = (pil_torch_interpolation_mapping[resample] if isinstance(resample, (PILImageResampling, int))
                     else resample)
    crops = []
    for image, seed in zip(images, seeds):
        pixels = torch.from_numpy(numpy.array(image)).permute(2, 0, 1)
        top, left, height, width = _crop_box(pixels.shape[1], pixels.shape[2], scale, random.Random(seed))
        crops.append(tvF.resized_crop(pixels, top, left, height, width, size, interpolation=interpolation,
                                      antialias=True))
    return _rescaled_and_normalized(image_processor, torch.stack(crops)) if normalize else torch.stack(crops)


def _crop_box(height: int, width: int, scale, rng: random.Random) -> tuple[int, int, int, int]:
    """(top, left, height, width) as torchvision's RandomResizedCrop.get_params draws it, from
    `rng`."""
    area, log_ratio = height * width, (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        ratio = math.exp(rng.uniform(*log_ratio))
        crop_width, crop_height = round(math.sqrt(target_area * ratio)), round(math.sqrt(target_area / ratio))
        if 0 < crop_width <= width and 0 < crop_height <= height:
            return rng.randint(0, height - crop_height), rng.randint(0, width - crop_width), crop_height, crop_width
    # torchvision's fallback: a centred crop at the nearest ratio allowed
    if width / height < 3 / 4:
        crop_width, crop_height = width, min(height, round(width * 4 / 3))
    elif width / height > 4 / 3:
        crop_width, crop_height = min(width, round(height * 4 / 3)), height
    else:
        crop_width, crop_height = width, height
    return (height - crop_height) // 2, (width - crop_width) // 2, crop_height, crop_width


def _standard_pipeline_applies(image_processor) -> bool:
    return (isinstance(image_processor, TorchvisionBackend) and not image_processor.do_pad
            and type(image_processor)._preprocess is TorchvisionBackend._preprocess)


def _standard_pipeline(processor, stack, normalize: bool):
    """TorchvisionBackend._preprocess's steps on one stack of equally sized uint8 images."""
    if processor.do_resize:
        stack = processor.resize(stack, processor.size, resample=processor.resample)
    if processor.do_center_crop:
        stack = processor.center_crop(stack, processor.crop_size)
    return _rescaled_and_normalized(processor, stack) if normalize else stack


def _rescaled_and_normalized(processor, stack):
    return processor.rescale_and_normalize(stack, processor.do_rescale, processor.rescale_factor,
                                           processor.do_normalize, processor.image_mean, processor.image_std)


def device_normalization(image_processor) -> torch.Tensor | None:
    """[2, channels] for finishing the standard pipeline's uint8 pixels on the device
    (`fused_normalization`); None when its pixels are finished in the workers (not the standard
    pipeline, or no rescale-normalise)."""
    return fused_normalization(image_processor) if _standard_pipeline_applies(image_processor) else None


def fused_normalization(processor) -> torch.Tensor | None:
    """[2, channels]: the mean and std in the fused form of an image or video processor's own
    `rescale_and_normalize` (mean / rescale, std / rescale: the same floats to the bit); None unless
    it both rescales and normalises."""
    if not (processor.do_rescale and processor.do_normalize):
        return None
    scale = 1.0 / processor.rescale_factor
    return torch.stack([torch.tensor(processor.image_mean) * scale, torch.tensor(processor.image_std) * scale])


def uint8_normalization(image_processor) -> torch.Tensor | None:
    """The `fused_normalization` with which a processor's images may cross the loader as uint8
    (`UINT8_PIXELS`) and be finished on the device: only where that gives its own float32 to the bit
    on two probe images of different sizes, in one call (every resize, crop, patching and padding
    happens before its rescale-normalise). None: its floats cross the loader (a processor that pads
    after normalising, or returns no uint8)."""
    normalization = fused_normalization(image_processor)
    if normalization is None:
        return None
    generator = numpy.random.default_rng(0)
    probes = [Image.fromarray(generator.integers(0, 256, (height, width, 3), dtype=numpy.uint8))
              for height, width in ((45, 61), (70, 33))]
    floats = image_processor(images=probes, return_tensors="pt")["pixel_values"]
    raw = image_processor(images=probes, return_tensors="pt", **UINT8_PIXELS)["pixel_values"]
    if raw.dtype != torch.uint8 or not torch.equal(finish_pixels(raw, normalization), floats):
        return None
    return normalization


def finish_pixels(pixels: torch.Tensor, normalization: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> the processor's float32 values, on the pixels' device: images and clips, with
    the channel axis third from last ([..., channels, height, width]) or the first factor of each
    flattened patch (Qwen-VL: [patches, channels x temporal x height x width])."""
    mean, std = normalization.to(pixels.device)
    values = pixels.to(torch.float32)
    channels_third_from_last = values.view(len(values), len(mean), -1, 1) if values.dim() == 2 else values
    # torchvision's normalize, which the processors' own `rescale_and_normalize` calls
    return tvF.normalize(channels_third_from_last, mean, std, inplace=True).view(values.shape)


def to_device(batch: dict, device) -> dict:
    """A collated batch's model inputs on `device`, for training, evaluation and the feature cache
    alike: every entry but the collator's host-side ones (`HOST_KEYS`; a Python value such as
    `dummy_image` stays as it is), with uint8 images and clips rescaled and normalised there by the
    constants their batch carries (`NORMALIZED_BY`)."""
    inputs = {key: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
              for key, value in batch.items() if key not in HOST_KEYS}
    for pixels, normalization in NORMALIZED_BY.items():
        if normalization in batch and pixels in inputs and inputs[pixels].dtype == torch.uint8:
            inputs[pixels] = finish_pixels(inputs[pixels], batch[normalization])
    return inputs
