"""The contrastive recipe's arguments (model, data, zero-shot), each with its value rules; no torch
(`--help`)."""

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ..arguments import SourceArgs
from ..config import CheckedArgs, checked
from ..paths import resolve_name

# What the log reports: images converted to RGB, and rows skipped because their image does not decode (or is not a
# regular file), is too large or too elongated, their caption is missing or not UTF-8, or their file is empty,
# unreadable or truncated (mmrecipes.sources)
COUNTED = ("converted", "undecodable", "too_large", "no_caption", "bad_text", "bad_row", "bad_shard")
# Audio-caption rows (CLAP, mmrecipes.contrastive.audio_pairs): skips, then rows noted ("audio_cropped": longer than
# the feature extractor's window)
AUDIO_PAIR_COUNTED = ("no_caption", "bad_text", "bad_row", "bad_shard", "no_audio", "audio_undecodable",
                      "audio_empty", "audio_too_long", "audio_silent", "audio_cropped")


@dataclass
class ModelArgs(CheckedArgs):
    UNUSED_WITH = {"model_name_or_path": ("tokenizer_name", "image_size", "patch_size", "hidden_size", "num_layers",
                                          "projection_dim")}
    # clip: CLIPModel with clip_loss (softmax over the batch); siglip: SiglipModel or Siglip2Model with siglip_loss
    # (sigmoid per pair)
    loss: str = checked("clip", choices=("clip", "siglip"))
    # a saved CLIP/SigLIP/SigLIP 2 directory or hub id; None builds a tiny one
    model_name_or_path: str | None = None
    # SigLIP 2 NaFlex: each image resized to at most this many patches, its aspect ratio kept. With --loss siglip
    # and no model_name_or_path it builds a tiny Siglip2Model; with a SigLIP 2 checkpoint it replaces its
    # processor's limit (the position embeddings are resized to each image's grid either way).
    max_num_patches: int | None = checked(None, "patches")
    # The rest shape the tiny model only (model_name_or_path=None).
    # default: the embedded tiny one (SigLIP 2: of its own class, Siglip2Tokenizer)
    tokenizer_name: str | None = None
    image_size: int = checked(32, "count")
    patch_size: int = checked(8, "count")
    hidden_size: int = checked(64, "count")
    num_layers: int = checked(2, "count")
    projection_dim: int = checked(64, "count")  # CLIP only: SigLIP has no projection
    # default ln(1/0.07) (CLIP) or ln(10) (SigLIP paper)
    logit_scale_init_value: float | None = None
    logit_bias_init_value: float = -10.0  # SigLIP only (paper)
    # sdpa: PyTorch's fused attention (flash/memory-efficient kernels on CUDA); eager: the reference
    # math; flash_attention_2 needs the flash-attn package. Checked when the model is built. None:
    # sdpa where the model has it (CLIP, SigLIP), else eager (CLAP has only eager)
    attn_implementation: str | None = None
    # recompute activations in backward: less memory, ~1/3 more compute
    gradient_checkpointing: bool = False
    # FLIP's patch dropout: training keeps a random 1 - p of each image's patches (mmrecipes.patch_dropout)
    patch_dropout: float = checked(0.0, "fraction")
    # A checkpoint-N directory (any engine's, any number of processes) whose model weights start this run, which
    # is new: step 0, a fresh optimizer and schedule, the data from the start (resuming: --resume_from_checkpoint)
    init_from_checkpoint: str | None = None


@dataclass
class DataArgs(SourceArgs):
    """Image-caption data: the shared data flags (`SourceArgs`) and the contrastive pipeline's
    own."""

    image_column: str = "image"
    # CLAP's clips (bytes, a path or a {"bytes", "path"} dict; webdataset: flac, wav or mp3); read where the
    # data has no --image_column. The caption column may hold LAION's audio .json (its "text")
    audio_column: str = "audio"
    caption_column: str = "text"
    # longer clips are skipped and counted (audio_too_long), from the header where it says
    audio_max_seconds: float = checked(600.0, "positive")
    # tokens; default the tokenizer's model_max_length
    max_caption_length: int | None = checked(None, "count_or_none")
    # open_clip's training crop (its --aug-cfg defaults): a random 90-100% of each image's area at an aspect
    # ratio of 3/4 to 4/3, resized to the processor's size, instead of its eval resize and centre crop.
    # Evaluation is not augmented; each row's crop follows from its place in the stream (exact resume).
    train_augment: bool = False
    # SigLIP 2 NaFlex: each training micro-batch holds whole rows, in stream order, up to this many image patches
    # together (images of fewer patches, more rows); per_device_train_batch_size then only sets how many rows are
    # preprocessed at a time. Ranks may hold different row counts: siglip_loss stays exact.
    max_patches_per_batch: int | None = checked(None, "count_or_none")

    def counted(self, modality: str = "image") -> tuple[str, ...]:
        """What a batch's `data_counts` holds: `COUNTED` (audio: `AUDIO_PAIR_COUNTED`), then the rows
        of each source where there are several."""
        counted = AUDIO_PAIR_COUNTED if modality == "audio" else COUNTED
        sources = self.training_sources()
        if len(sources) == 1:
            return counted
        labels = [Path(resolve_name(name).rstrip("/")).name or name for name, *_ in sources]
        labels = labels if len(set(labels)) == len(labels) else [str(index) for index in range(len(sources))]
        return counted + tuple(f"rows_{label}" for label in labels)


# CLAP's evaluations (LAION-CLAP, MS-CLAP)
AUDIO_TEMPLATES = "This is a sound of {}."
DEFAULT_TEMPLATES = ("a photo of a {}.|a photo of the {}.|a rendering of a {}.|a {}.|a picture of a small {}.|"
                     "a picture of a large {}.")


@dataclass
class ZeroShotArgs(CheckedArgs):
    # beside the embedded training data, by what it pairs captions with
    EMBEDDED_SETS: ClassVar[dict] = {"image": "embedded:shapes_zeroshot", "audio": "embedded:audio_zeroshot"}
    # A hub id, a builder with --zeroshot_data_files, or a local directory (an image folder with one
    # sub-folder per class is read as imagefolder); auto: the embedded shapes beside the embedded
    # training data only; None turns zero-shot evaluation off.
    zeroshot_dataset: str | None = "auto"
    zeroshot_data_files: str | None = None
    zeroshot_split: str | None = None  # default: test, or the only split there is
    zeroshot_image_column: str = "image"
    zeroshot_audio_column: str = "audio"  # a model that hears (CLAP) reads its clips from here
    zeroshot_label_column: str = "label"
    # comma-separated; default: the label column's ClassLabel names
    zeroshot_class_names: str | None = None
    # "|"-separated, each with one {} for the class name; default: open_clip's image prompts, or for a model that
    # hears "This is a sound of {}."
    zeroshot_templates: str | None = None
    per_device_zeroshot_batch_size: int = checked(64, "count")

    def __post_init__(self):
        super().__post_init__()
        if self.zeroshot_data_files and self.zeroshot_dataset == "auto":
            raise ValueError("--zeroshot_data_files is read by the builder --zeroshot_dataset names: set it (e.g. "
                             "--zeroshot_dataset imagefolder)")
