"""A batch's audio clips encoded once, before the language model, on every rank whatever the batch holds, and each
clip's placeholders checked against the rows its encoder gives, clip by clip, on every batch.

The families encode audio inside their forward (Gemma 4 after its embedding lookup), where the dummy sound of a batch
without a clip cannot go: it has no placeholders. So the tower runs here for both, in one place, as the vision step
does: ZeRO-3 gathers the ranks' modules in one order (a rank encoding its clips inside the forward and another its
dummy before it wait on each other's gathers forever), and the family's forward is given the features
(`AudioRows.given`) instead of encoding them again.

The families check their image placeholders in the forward; audio is checked by some (Gemma 4: the batch's total
only) and by none of the Omni thinkers, whose `masked_scatter` fills fewer placeholders with the head of the features
and trains on it. A total is not enough either: two clips whose placeholder counts are swapped pass it, each clip's
rows then standing in for the other's sound. `AudioRows.encode` refuses a batch whose runs of placeholders, in order,
are not the encoder's valid rows per clip, before any loss or gradient comes of it.
"""

import contextlib
import inspect
import sys

import torch
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ...audio import encodes_audio_inline, window_seconds
from ...audio_windows import WINDOWS
from ..rows.labels import feature_mask


class AudioRows:
    """The audio step of a model that hears (`audio_step`: its base model's `get_audio_features`, or the same
    computation for a family that encodes its clips inline) and its placeholder token."""

    def __init__(self, model, input_names: tuple):
        self.base_model, self.input_names = model.base_model, input_names
        self.step = audio_step(self.base_model)
        # a batch holds clips (or the dummy sound) when it holds these
        self.features = input_names[0]
        self.token_id = next(value for name in ("audio_token_id", "audio_token_index")
                             if isinstance(value := getattr(model.config, name, None), int))
        # frames -> rows of the tower, found once (not on every batch)
        self.lengths = length_formula(getattr(self.base_model, "audio_tower", None))

    def encode(self, input_ids: torch.Tensor, media_inputs: dict, dummy: bool):
        """The audio tower's output for the batch's clips (or the dummy sound), each clip's rows
        checked against its run of placeholders in `input_ids` (not the dummy's: it has none)."""
        inputs = {name: media_inputs[name] for name in self.input_names if name in media_inputs}
        output = self.step(**inputs, return_dict=True)
        if not dummy:
            expected = placeholder_runs(input_ids, self.token_id)
            rows = self.encoder_rows(output, inputs, media_inputs.get(WINDOWS))
            if rows != expected:
                raise ValueError(
                    f"audio placeholders per clip {expected}, the audio encoder's rows per clip "
                    f"{rows}: each clip must have exactly as many placeholders as its encoder gives "
                    "rows, or its sound would be trained in the wrong place, or in part (the "
                    "processor and its feature extractor disagree with the model: a truncating, "
                    "padded or edited feature extractor, or placeholders written by hand)")
        return output

    @torch.no_grad()
    def check_family(self, dummy_inputs: dict):
        """Refuse, before the first step, a family whose clips' encoder rows cannot be told
        (`encoder_rows` on the dummy sound in `dummy_inputs`)."""
        inputs = {name: dummy_inputs[name] for name in self.input_names if name in dummy_inputs}
        self.encoder_rows(self.step(**inputs, return_dict=True), inputs, dummy_inputs.get(WINDOWS))

    def window_seconds(self, processor) -> float | None:
        """The longest clip, in seconds, the audio tower reads (`audio.window_seconds`; None: any)."""
        return window_seconds(lambda made: self.step(**{name: made[name] for name in self.input_names if name in made},
                                                     return_dict=True), processor)

    def encoder_rows(self, output, inputs: dict, windows=None) -> list[int]:
        """The rows the audio tower gives each clip: its output's mask where it gives one (Gemma 4:
        True, a row of the clip); for clips in whole windows (`windows` a clip: Voxtral's), a
        window's rows of the output times the clip's windows; else the tower's own length formula
        over each clip's frames (the Omni thinkers' output is their clips' rows end to end, split by
        that formula), its total checked against the output's rows."""
        if windows is not None:
            rows, given = len(output.pooler_output), len(inputs[self.features])
            if given != int(windows.sum()) or rows % given:
                raise ValueError(f"{given} windows of features for clips of {windows.tolist()} "
                                 f"windows, {rows} encoder rows")
            return (windows * (rows // given)).tolist()
        mask = getattr(output, "attention_mask", None)
        if mask is not None:
            return mask.sum(-1).tolist()
        frames = feature_mask(inputs)
        if self.lengths is None or frames is None:
            raise ValueError(
                f"{type(output).__name__} gives no attention_mask, and the audio tower no length "
                "formula over a feature mask: the rows of each clip cannot be checked against its "
                "placeholders, so this family's audio is not trained here")
        rows = self.lengths(frames.sum(-1))
        # Qwen2.5-Omni's: (after the convolutions, out)
        rows = (rows[-1] if isinstance(rows, tuple) else rows).tolist()
        if sum(rows) != len(output.last_hidden_state):
            raise ValueError(f"the audio encoder gives {len(output.last_hidden_state)} rows for "
                             f"clips of {rows} rows")
        return rows

    @contextlib.contextmanager
    def given(self, output, inputs: dict, embeddings):
        """The family's forward is given `output`, the batch's clips encoded (None: the dummy sound's, which it never
        takes), not encoding them again: while the body runs, from its own `get_audio_features` call; where it
        encodes its clips inline (`InlineAudioFeatures`), as the embeddings of the language model `inputs` it
        yields (`embedded`)."""
        if isinstance(self.step, InlineAudioFeatures):
            yield self.embedded(inputs, output, embeddings)
            return
        if output is None:
            yield inputs
            return
        self.base_model.get_audio_features = lambda *args, **kwargs: output
        try:
            yield inputs
        finally:
            del self.base_model.get_audio_features

    def embedded(self, inputs: dict, output, embeddings) -> dict:
        """The language model's `inputs` with the token embeddings, each clip's rows of `output` scattered into its
        placeholders (None: none), in place of the ids and the clips."""
        inputs = {name: value for name, value in inputs.items() if name not in self.input_names}
        input_ids = inputs.pop("input_ids")
        embeds = embeddings(input_ids)
        if output is not None:
            placeholders = (input_ids == self.token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(placeholders, output.pooler_output.to(embeds.dtype))
        return inputs | {"inputs_embeds": embeds}


def audio_step(base_model):
    """What encodes a batch's clips: the base model's `get_audio_features`, else `InlineAudioFeatures`."""
    return InlineAudioFeatures(base_model) if encodes_audio_inline(base_model) else base_model.get_audio_features


class InlineAudioFeatures:
    """`get_audio_features` for a family whose forward encodes its clips inline and has none (Qwen2-Audio): what that
    forward scatters into the placeholders, computed as it computes it. The audio tower over the clips' frames, each
    clip attending to its own frames after the convolutions (the feature mask), then the projector; each clip's rows
    by the tower's length formula, end to end."""

    def __init__(self, base_model):
        self.tower, self.projector = base_model.audio_tower, base_model.multi_modal_projector
        self.lengths = length_formula(self.tower)

    def __call__(self, input_features, feature_attention_mask, **kwargs):
        after_convolutions, rows = self.lengths(feature_attention_mask.sum(-1))
        length = int(self.lengths(torch.tensor(input_features.shape[-1]))[0])
        frames = torch.arange(length, device=input_features.device)
        mask = create_bidirectional_mask(config=self.tower.config, attention_mask=frames < after_convolutions[:, None],
                                         inputs_embeds=input_features.new_zeros(len(input_features), length, 1,
                                                                                dtype=self.tower.dtype))
        projected = self.projector(self.tower(input_features, attention_mask=mask).last_hidden_state)
        kept = projected[frames[:projected.shape[1]] < rows[:, None]]
        return BaseModelOutputWithPooling(last_hidden_state=kept, pooler_output=kept)


def length_formula(tower):
    """Frames -> rows of an audio `tower`: its method (Qwen2.5-Omni's), else its module's function of that
    name at the tower's window (Qwen3-Omni's `n_window`); None where there is neither."""
    name = "_get_feat_extract_output_lengths"
    if (method := getattr(tower, name, None)) is not None:
        return method
    # the module of the tower's own class (FSDP2 wraps it in a class of its own module)
    modules = [sys.modules.get(cls.__module__) for cls in type(tower).__mro__] if tower is not None else []
    function = next((found for module in modules if (found := getattr(module, name, None))), None)
    if function is None:
        return None
    window = {"n_window": tower.n_window} if "n_window" in inspect.signature(function).parameters else {}
    return lambda frames: function(frames, **window)


def placeholder_runs(input_ids: torch.Tensor, token_id: int) -> list[int]:
    """The lengths of the runs of `token_id` in `[rows, tokens]`, row by row, in order (a run never crosses rows)."""
    marks = torch.nn.functional.pad((input_ids == token_id).int(), (1, 1)).flatten()
    edges = torch.diff(marks)
    return ((edges == -1).nonzero() - (edges == 1).nonzero()).flatten().tolist()
