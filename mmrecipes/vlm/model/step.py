"""The VLM step, `VLMForTraining`: any `AutoModelForImageTextToText` model running the same graph on
every rank whatever each rank's batch holds, its outputs objects (`outputs`); saving (`save_vlm`).

Every micro-batch calls the vision step once (its images and clips, or the collator's tiny dummy
image), and a dummy's features enter the output as a zero-length slice inside the module the engine
wraps: a text-only rank runs the vision tower's collectives too, and the loss and gradients stay
bitwise the text's (docs/vlm.md, "Mixed text-only / image batches"). Losses come from the last
hidden states through the output layer in slices (`losses`): the fp32 logits of a whole batch never
exist in training. Family differences come from signatures, configs and the module tree
(`families`), never a name. The step reads no parameter itself: under ZeRO-3 that would gather it on
one rank only.
"""

import contextlib
import inspect

import torch

from ...distributed import fsdp_block_classes
from ..rows.packing import packed_position_ids
from .audio_rows import AudioRows
from .families import (
    audio_inputs,
    height_width,
    lm_features,
    split_items,
    stateful_mixer_classes,
    video_as_image_names,
    vision_inputs,
)
from .lora import save_lora
from .outputs import Forward, StepOutput
from .segments import check_segment_aware, segment_ids


class VLMForTraining(torch.nn.Module):
    """One training/eval step of an image-text-to-text model that is the same graph on every rank.

    Its outputs are objects (`outputs`: `LossSum`, `SequenceLogps`, `TokenLogps`, `GeneralizedJSD`,
    `Logits`, `Hidden`, or a recipe's own), and each is one call of the module, `model(batch,
    output)`, the prepared one included: the engine's forward runs its hooks (DDP's, FSDP2's
    unsharding, ZeRO-3's gathers) around everything, and the dummy's features enter the output
    inside it. Wrap the model *before* `accelerator.prepare`, or DDP sees the vision parameters'
    (zero) gradients too late.
    """

    def __init__(self, model, sequence_parallel=None):
        super().__init__()
        self.model = model
        self.sequence_parallel = sequence_parallel  # training splits each sequence over its ranks
        self.vision_input_names = vision_inputs(model)
        self.video_as_image = video_as_image_names(model)
        # a model that hears: its audio step's inputs, and each clip's placeholders checked against its encoder rows
        names = audio_inputs(model)
        self.audio_input_names = set(names)
        self.audio_rows = AudioRows(model, names) if names else None
        self.forward_input_names = set(inspect.signature(model.forward).parameters) - {"kwargs"}
        self.softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        self.clip_layout = _clip_layout(model) if not self.video_as_image else None
        # Linear-attention layers: a packed batch gives them each token's segment (`segments`, applied by vlm_parts)
        self.mixer_classes = tuple(set().union(*stateful_mixer_classes(model).values()))
        # from_pretrained leaves a model in eval mode: no dropout, and no gradient checkpointing (transformers
        # checkpoints only in training mode), until an evaluation's train() would turn them on mid-run
        model.train()

    def forward(self, batch: dict, output: StepOutput) -> torch.Tensor:
        """`output` (`outputs.StepOutput`) of a `ChatCollator` batch on the device
        (`images.to_device`): the hidden states (split over a sequence-parallel group where the
        output splits, in training), then the output, plus the dummy's zero term where a backward
        follows."""
        head = self.model.get_output_embeddings()
        if not output.runs_model:
            return output.compute(Forward(None, head, self.softcap, batch))
        split = self.sequence_parallel is not None and self.training
        if split:
            output.check_split()
        split = split and output.splits
        splitting = self.sequence_parallel.splitting(split) if self.sequence_parallel else contextlib.nullcontext()
        with splitting as this_forward:  # sequence parallel: its `shard` once the language model ran
            hidden, dummies, router_logits = self._hidden_states(**batch, output_router_logits=output.routing)
        shard = this_forward.shard if this_forward is not None else None
        value = output.compute(Forward(hidden=hidden, head=head, softcap=self.softcap, batch=batch, shard=shard,
                                       router_logits=router_logits))
        if shard is not None:
            value = output.reduce(value, shard)
        return output.plus(value, self._dummy_terms(dummies)) if output.trains else value

    @staticmethod
    def _dummy_terms(dummies) -> torch.Tensor | float:
        """Exact zeros from the dummies' features: their parameters get their gradients on every
        rank."""
        return sum(torch.cat([part.flatten() for part in lm_features(dummy)])[:0].sum() for dummy in dummies)

    def _hidden_states(self, input_ids, attention_mask, labels, dummy_image: bool, dummy_video=False,
                       dummy_audio=False, sample_lengths=None, media_per_sample=None, video_frames=None,
                       output_router_logits=False, **media_inputs):
        """(the base model's last hidden states, the dummies' features, its router logits if asked):
        the media encoded in one vision call (`encode_media`) and, where the model hears, one audio call
        (`AudioRows`), then the language model on the merged sequence (`lm_inputs`)."""
        encoded, dummies = self.encode_media(media_inputs, dummy_image, dummy_video, video_frames)
        heard = None
        if self.audio_rows is not None and self.audio_rows.features in media_inputs:
            heard = self.audio_rows.encode(input_ids, media_inputs, dummy_audio)
            if dummy_audio:
                dummies.append(heard)
        dropped = self.dummy_input_names({"dummy_image": dummy_image, "dummy_audio": dummy_audio})
        inputs = self.lm_inputs(input_ids, attention_mask, media_inputs, encoded, dropped, sample_lengths,
                                media_per_sample)
        if output_router_logits:
            inputs["output_router_logits"] = True
        hearing = contextlib.nullcontext(inputs) if self.audio_rows is None else self.audio_rows.given(
            None if dummy_audio else heard, inputs, self.model.get_input_embeddings())
        with hearing as inputs:
            # No KV cache: training needs none, and transformers reads packed positions only without one.
            outputs = self.model.base_model(use_cache=False, **inputs)
        return outputs[0], dummies, outputs.router_logits if output_router_logits else None

    def dummy_input_names(self, batch: dict) -> set[str]:
        """The inputs of a collated batch that are its dummies', which the language model never takes."""
        return ((self.vision_input_names if batch["dummy_image"] else set())
                | ({"pixel_values_videos"} if batch.get("dummy_video") else set())
                | (self.audio_input_names if batch.get("dummy_audio") else set()))

    def encode_media(self, media_inputs: dict, dummy_image: bool, dummy_video=False, video_frames=None):
        """({"image": features, "video": features} of what the batch holds, [the dummies'
        features]): one vision call for the images, the clips where the family takes them as images,
        or the dummy image (split, each rank of a sequence-parallel group encodes a share:
        `VisionShare`); a video path of the model's own after it. A model that only hears: nothing."""
        if not self.vision_input_names:
            return {}, []
        vision_inputs = {name: value for name, value in media_inputs.items() if name in self.vision_input_names}
        videos = {name: value for name, value in media_inputs.items() if name in self.video_as_image}
        # Videos go through the tower in the same call as the images (or the dummy), after them: one call a step.
        joined = {self.video_as_image[name]: torch.cat([vision_inputs[self.video_as_image[name]], value])
                  for name, value in videos.items()}
        features, spare = self.image_features(vision_inputs | joined)
        encoded = {}
        if videos:
            grid = next(value for name, value in videos.items() if self.video_as_image[name] != "pixel_values")
            features, encoded["video"] = split_items(features, len(features.pooler_output) - len(grid))
        # a video path of its own
        if "pixel_values_videos" in media_inputs and not self.video_as_image:
            encoded["video"] = self.own_video_features(media_inputs["pixel_values_videos"], video_frames)
        dummies = ([features] if dummy_image else []) + ([spare] if spare is not None else [])
        if dummy_video:
            dummies.append(encoded.pop("video"))
        if not dummy_image:
            encoded["image"] = features
        return encoded, dummies

    def image_features(self, vision_inputs: dict) -> tuple:
        """(the vision tower's features, a spare dummy's or None): split, each rank of the
        sequence-parallel group encodes a share of the images and frames (`VisionShare`)."""
        if self.sequence_parallel:
            return self.sequence_parallel.image_features(self.model.get_image_features, vision_inputs)
        return self.model.get_image_features(**vision_inputs, return_dict=True), None

    def own_video_features(self, clips: torch.Tensor, video_frames=None):
        """The clips through the model's own video path; clips zero-padded to the longest
        (`video_frames`: each one's frames) keep their own frames' rows."""
        features = self.model.get_video_features(pixel_values_videos=clips, return_dict=True)
        if video_frames is not None:
            features.pooler_output = _own_frames(features.pooler_output, video_frames, self.clip_layout)
        return features

    def lm_inputs(self, input_ids, attention_mask, media_inputs: dict, encoded: dict, dummies: set,
                  sample_lengths=None, media_per_sample=None) -> dict:
        """What the language model takes: the ids and mask, the encoded media
        (`mm_encoder_outputs`), the family's other inputs (Qwen's image_grid_thw and
        mm_token_type_ids for mRoPE positions, Gemma 3's token_type_ids, Idefics3's
        pixel_attention_mask, LLaVA-OneVision's image_sizes, Gemma 4's audio features and their
        mask, already encoded: `AudioRows.given`; never the `dummies`' inputs: the LM sees no image
        and no image token of a text-only batch), and, packed, each sample's positions and segments
        (no mask: mmrecipes.vlm.rows.packing)."""
        pixels = {"pixel_values", "pixel_values_videos"}
        keep = self.forward_input_names - pixels - dummies
        inputs = {name: value for name, value in media_inputs.items() if name in keep}
        if encoded:
            inputs["mm_encoder_outputs"] = encoded
        if sample_lengths is not None:
            inputs["position_ids"] = packed_position_ids(self.model, input_ids, sample_lengths, media_per_sample,
                                                         media_inputs)
            if self.mixer_classes:
                check_segment_aware(self.mixer_classes)
                inputs["seq_idx"] = segment_ids(sample_lengths, input_ids.shape)
            attention_mask = None
        return inputs | {"input_ids": input_ids, "attention_mask": attention_mask}

    # accelerate's FSDP2 path asks the root module for both: it shards them in one group when they are
    # tied (Gemma 3, Qwen2.5-VL-3B), and torch refuses a tied weight in two groups.
    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    @property
    def _no_split_modules(self):  # what accelerate_configs/fsdp2.yaml wraps
        return fsdp_block_classes(self.model)


@torch.no_grad()
def _clip_layout(model) -> tuple[int, int] | None:
    """(rows per frame, rows after the frames) of a video path of the model's own, for one clip of
    `get_video_features`' output (LLaVA-OneVision: each frame's pooled patches, then a newline),
    read from a 1- and a 2-frame probe clip and checked: the 2-frame clip's first frame and last
    rows are the 1-frame clip's. None without such a path or such a layout."""
    if getattr(model, "get_video_features", None) is None:
        return None
    vision = model.config.vision_config
    height, width = height_width(getattr(vision, "image_size", 32))
    clip = torch.rand(1, 2, getattr(vision, "num_channels", 3), height, width,
                      generator=torch.Generator().manual_seed(0))
    training = model.training
    model.eval()  # no dropout between the two probes
    try:
        one, two = (model.get_video_features(pixel_values_videos=clip[:, :frames].to(model.dtype),
                                             return_dict=True).pooler_output[0] for frames in (1, 2))
    except (TypeError, ValueError, RuntimeError, AttributeError):
        return None
    finally:
        model.train(training)
    per_frame = len(two) - len(one)
    extra = len(one) - per_frame
    if per_frame <= 0 or extra < 0 or not (torch.allclose(two[:per_frame], one[:per_frame], atol=1e-4)
                                           and torch.allclose(two[len(two) - extra:], one[per_frame:], atol=1e-4)):
        return None
    return per_frame, extra


def _own_frames(features, frames: list[int], layout) -> torch.Tensor:
    """[clips, padded frames' rows, D] -> [1, rows, D]: each clip's own frames' rows and its last
    rows, in order."""
    if layout is None:
        raise ValueError("clips of different frame counts met in one micro-batch, and this model's video features "
                         "are not laid out frame by frame: give every clip the same frames (--video_max_frames at "
                         "most the shortest clip's) or --per_device_train_batch_size 1")
    per_frame, extra = layout
    return torch.cat([torch.cat([clip[:count * per_frame], clip[len(clip) - extra:]])
                      for clip, count in zip(features, frames)])[None]


def save_vlm(accelerator, model, processor, output_dir, peft_config=None):
    """`save_pretrained` the wrapped model and its processor: a directory that `AutoProcessor`,
    `AutoModelForImageTextToText` and `pipeline("image-text-to-text")` load. With LoRA
    (`peft_config`), the merged model there and the adapter in `output_dir/adapter` (`save_lora`).

    `get_state_dict` gathers full weights under FSDP2/ZeRO-3, so every rank must call this.
    """
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        inner = accelerator.unwrap_model(model).model
        # A tied weight (lm_head = embed_tokens) is written once, as by save_pretrained itself:
        # gathered under FSDP2 the two names hold separate copies it would not recognise as one.
        tied_copies = ({name for name, _ in inner.named_parameters(remove_duplicate=False)}
                       - {name for name, _ in inner.named_parameters()})
        state_dict = {name.removeprefix("model."): tensor for name, tensor in state_dict.items()
                      if name.removeprefix("model.") not in tied_copies}
        without_call_settings(processor.tokenizer)
        if peft_config is None:
            inner.save_pretrained(output_dir, state_dict=state_dict, save_function=accelerator.save)
            processor.save_pretrained(output_dir)
        else:
            save_lora(peft_config, inner, state_dict, processor, output_dir)
    accelerator.wait_for_everyone()


def without_call_settings(tokenizer):
    """Clear the padding and truncation a fast tokenizer's last call left on its backend, which `save_pretrained`
    would write into tokenizer.json as the tokenizer's own (every call sets its own again). Gemma 4's processor pads
    each call; reloaded with that padding saved, it truncates its audio features by default, finds no max_length and
    refuses every clip, the any-to-any pipeline's included."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        backend.no_padding()
        backend.no_truncation()
