"""Tiny checkpoints of the image-text-to-text families of 2026, saved in their hub layout (as tiny_vlm.py's):

    python data_prep/tiny_vlm_2026.py --family qwen3_5 --output_dir /tmp/tiny-qwen3_5
    accelerate launch recipes/vlm_finetune.py --model_name_or_path /tmp/tiny-qwen3_5

- `qwen3_5`: Qwen3.5 (Qwen/Qwen3.5-2B and smaller: `qwen3_5_nothink.jinja`): Gated DeltaNet (linear attention
  with a causal convolution) in every layer but the last of each group, gated full attention there; partial,
  interleaved mRoPE; Qwen3-VL's processor and vision tower.
- `qwen3_5_think`: the same model with the template of Qwen3.5-4B and larger (`qwen3_5_think.jinja`), whose
  generation prompt opens a think block the model fills.
- `qwen3_vl_moe`: Qwen3-VL-30B-A3B (Qwen3-VL-8B's template): every decoder MLP a sparse block of 4 experts, 2 per
  token (the checkpoint: 128, 8), the experts fused into 3-D parameters as transformers 5 holds them.
- `qwen3_5_moe`: Qwen3.5-35B-A3B (`qwen3_5_think.jinja`): Qwen3.5's hybrid layers, each MLP a sparse block of 4
  experts, 2 per token, beside a gated shared expert.
- `gemma4`: Gemma 4 (google/gemma-4-E2B-it's current template, `gemma4.jinja`): per-layer embeddings, the last two
  of four layers sharing the KV of the first two, sliding and full attention; a vision tower whose patches are
  pooled 2 x 2 into at least 70 soft tokens an image (the processor's smallest budget); E2B's audio tower (a
  conformer after two stride-2 convolutions: 25 soft tokens a second of 16 kHz audio) beside it, fed by the
  processor's audio feature extractor.
- `gemma4_moe`: Gemma 4 26B-A4B's layout: each layer's MLP beside a router and 4 experts, 2 per token; image
  tokens attend to each other both ways (`use_bidirectional_attention="vision"`, as 26B-A4B and 31B; E2B and E4B
  attend causally); no audio tower (26B-A4B and 31B hear nothing).
- `qwen2_5_omni`: the thinker of Qwen2.5-Omni (Qwen/Qwen2.5-Omni-7B's chat template, `qwen2_5_omni.jinja`), the
  part that reads and writes text: Qwen2.5-VL's windowed vision tower, and a Whisper-style audio encoder (two
  convolutions, then attention in windows of 100 frames, pooled 2:1: 25 soft tokens a second of 16 kHz audio) fed by
  the Whisper feature extractor (128 mel bins); 3-D mRoPE over text, image and video, audio positions as text's.
- `qwen3_omni_moe`: the thinker of Qwen3-Omni-30B-A3B (Qwen/Qwen3-Omni-30B-A3B-Thinking's chat template,
  `qwen3_omni_thinking.jinja`): Qwen3-VL's vision tower (deepstack), every decoder MLP a sparse block of 4 experts,
  2 per token (the checkpoint: 128, 8), and an audio encoder of three stride-2 convolutions, attention in windows of
  100 frames (12.5 soft tokens a second of 16 kHz audio) fed by the Whisper feature extractor (128 mel bins).
- `qwen2_audio`: Qwen2-Audio (Qwen/Qwen2-Audio-7B-Instruct): a Whisper-style encoder and a projector before Qwen2,
  no vision tower (it loads with `AutoModelForMultimodalLM`); the template of its processor class.
- `voxtral`: Voxtral (mistralai/Voxtral-Mini-3B-2507): a Whisper-style encoder over 30 s windows (1500 positions
  after its convolutions, 4 to a soft token: 375 a window) and a projector before Llama; no vision tower (it loads
  with `AutoModelForMultimodalLM`). Its tokenizer is a Tekken file (`tekken.json`, as the checkpoint ships it: a
  byte-level vocabulary here, Tekken's special tokens at their ids, the audio settings mistral_common reads) that
  transformers converts; the template is the one mistral_common writes for it (`voxtral.jinja`).
- `qwen2_5_omni_full`: the whole Qwen2.5-Omni checkpoint (as Qwen/Qwen2.5-Omni-7B ships): `qwen2_5_omni`'s thinker
  beside a talker and a token-to-waveform model at toy size, which speak; the recipes train its thinker (not in
  FAMILIES, the image-text-to-text checkpoints: it is not one); `qwen3_omni_moe_full` likewise around
  `qwen3_omni_moe`'s thinker (a talker with its code predictor, and a code-to-waveform model).
"""

import tempfile
from pathlib import Path

from transformers import (
    Gemma4AudioConfig,
    Gemma4AudioFeatureExtractor,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessor,
    Gemma4Processor,
    Gemma4VideoProcessor,
    Qwen2_5OmniConfig,
    Qwen2_5OmniForConditionalGeneration,
    Qwen2_5OmniProcessor,
    Qwen2_5OmniThinkerConfig,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2AudioConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2AudioProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeForConditionalGeneration,
    Qwen3OmniMoeProcessor,
    Qwen3OmniMoeThinkerConfig,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
    VoxtralConfig,
    VoxtralForConditionalGeneration,
    VoxtralProcessor,
    WhisperFeatureExtractor,
)
from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

from tekken import tekken_file
from tiny_vlm import (
    QWEN_TOKENS,
    TEXT,
    VISION,
    _qwen,
    _stop_on,
    family_main,
    save_family,
    template,
    train_tokenizer,
)

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, router_aux_loss_coef=0.001)
# Qwen3.5's layer pattern at toy size: a linear-attention layer, then a full-attention one (3:1 in the checkpoints)
HYBRID = dict(layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)


def qwen3_5(template_name="qwen3_5_nothink"):
    """Qwen3.5 dense: head_dim 32 with a quarter of it rotated (the checkpoints': 256 and 0.25), the rotated pairs
    split over time, height and width as [2, 1, 1] (theirs: [11, 11, 10]) and interleaved."""
    return _qwen((Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor),
                 template_name, vision=dict(num_position_embeddings=64),
                 rope=dict(mrope_section=[2, 1, 1], mrope_interleaved=True, partial_rotary_factor=0.25),
                 text=dict(head_dim=32, **HYBRID), added_tokens=["<think>", "</think>"])


def qwen3_5_think():
    return qwen3_5("qwen3_5_think")


def qwen3_vl_moe():
    return _qwen((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor),
                 "qwen3_vl", vision=dict(num_position_embeddings=64, deepstack_visual_indexes=[0]),
                 rope=dict(mrope_section=[2, 3, 3], mrope_interleaved=True), text=dict(decoder_sparse_step=1, **MOE))


def qwen3_5_moe():
    return _qwen((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor),
                 "qwen3_5_think", vision=dict(num_position_embeddings=64),
                 rope=dict(mrope_section=[2, 1, 1], mrope_interleaved=True, partial_rotary_factor=0.25),
                 text=dict(head_dim=32, shared_expert_intermediate_size=32, **HYBRID, **MOE),
                 added_tokens=["<think>", "</think>"])


# E2B's audio tower at toy size (its widths 1024 and 1536, 12 layers of 8 heads); the subsampling convolutions as theirs
AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, output_proj_dims=32)


def gemma4(audio=True, **layout):
    """Gemma 4 E2B's layout by default, its audio tower included (`layout`: text config settings over it)."""
    specials = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>", "<|audio>",
                "<audio|>", "<|audio|>", "<|video|>", "<|channel>", "<channel|>", "<|think|>"]
    tokenizer = train_tokenizer(specials, bos="<bos>", eos="<eos>", pad="<pad>", extra_special_tokens={
        "boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>", "boa_token": "<|audio>",
        "eoa_token": "<audio|>", "audio_token": "<|audio|>"})
    ids = tokenizer.convert_tokens_to_ids
    text = TEXT | dict(vocab_size=len(tokenizer), num_hidden_layers=4, global_head_dim=16, sliding_window=64,
                       layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                       hidden_size_per_layer_input=16, vocab_size_per_layer_input=len(tokenizer),
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id) | layout
    config = Gemma4Config(
        text_config=text, vision_config=VISION | dict(num_key_value_heads=2, head_dim=16, patch_size=8,
                                                      pooling_kernel_size=2, position_embedding_size=64),
        audio_config=Gemma4AudioConfig(**AUDIO) if audio else None, boi_token_id=ids("<|image>"),
        eoi_token_id=ids("<image|>"), image_token_id=ids("<|image|>"), video_token_id=ids("<|video|>"),
        boa_token_id=ids("<|audio>"), eoa_token_index=ids("<audio|>"), audio_token_id=ids("<|audio|>"))
    pixels = dict(patch_size=8, max_soft_tokens=70, pooling_kernel_size=2)
    processor = Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(),
                                image_processor=Gemma4ImageProcessor(**pixels), tokenizer=tokenizer,
                                video_processor=Gemma4VideoProcessor(**pixels), chat_template=template("gemma4"),
                                image_seq_length=70)
    model = Gemma4ForConditionalGeneration(config)
    _stop_on(model, ids("<turn|>"), ids("<eos>"))
    return model, processor


def gemma4_moe():
    """Gemma 4 26B-A4B's layout: no per-layer embeddings nor KV sharing, image tokens attending both ways."""
    return gemma4(audio=False, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                  hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_bidirectional_attention="vision")


OMNI_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
               "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>", "<|IMAGE|>", "<|VIDEO|>"]


def qwen2_5_omni():
    """The Qwen2.5-Omni thinker at toy size (the checkpoint's audio encoder: 32 layers of width 1280; its 30 s window
    of 3000 frames, 1500 positions, is the Whisper extractor's default cut, which the recipes turn off)."""
    tokenizer = train_tokenizer(OMNI_TOKENS, eos="<|im_end|>", pad="<|endoftext|>", extra_special_tokens={
        "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
        "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
        "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"})
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5OmniThinkerConfig(
        audio_config=dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                          d_model=32, output_dim=TEXT["hidden_size"]),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=TEXT["hidden_size"],
                           window_size=16, fullatt_block_indexes=[1]),
        text_config=dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **TEXT,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]}),
        audio_token_index=ids("<|AUDIO|>"), image_token_index=ids("<|IMAGE|>"), video_token_index=ids("<|VIDEO|>"),
        audio_start_token_id=ids("<|audio_bos|>"), audio_end_token_id=ids("<|audio_eos|>"),
        vision_start_token_id=ids("<|vision_bos|>"), vision_end_token_id=ids("<|vision_eos|>"))
    return _omni(config, tokenizer, Qwen2_5OmniProcessor, Qwen2_5OmniThinkerForConditionalGeneration, "qwen2_5_omni")


def _omni(config, tokenizer, processor_class, model_class, template_name):
    """An Omni thinker and its processor: Qwen2-VL's image and video processors on a 4-px patch grid merged 2 x 2,
    the Whisper feature extractor with 128 mel bins, the family's official template."""
    pixels = dict(patch_size=4, merge_size=2, temporal_patch_size=2,
                  size={"shortest_edge": 8 * 8, "longest_edge": 64 * 64})
    processor = processor_class(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer,
                                video_processor=Qwen2VLVideoProcessor(**pixels),
                                feature_extractor=WhisperFeatureExtractor(feature_size=128),
                                chat_template=template(template_name))
    model = model_class(config)
    _stop_on(model, *tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    return model, processor


def qwen3_omni_moe():
    """The Qwen3-Omni-30B-A3B thinker at toy size (the checkpoint's audio encoder: 32 layers of width 1280; its
    config names the vision and audio start tokens the 3-D positions read, which its class leaves out)."""
    tokenizer = train_tokenizer([*QWEN_TOKENS, "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"], eos="<|im_end|>",
                                pad="<|endoftext|>", extra_special_tokens={
                                    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                    "audio_token": "<|audio_pad|>", "vision_bos_token": "<|vision_start|>",
                                    "vision_eos_token": "<|vision_end|>", "audio_bos_token": "<|audio_start|>",
                                    "audio_eos_token": "<|audio_end|>"})
    tokenizer.add_tokens(["<think>", "</think>"])
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3OmniMoeThinkerConfig(
        audio_config=dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                          d_model=32, output_dim=TEXT["hidden_size"], downsample_hidden_size=8),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=TEXT["hidden_size"],
                           num_position_embeddings=64, deepstack_visual_indexes=[0]),
        text_config=dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, decoder_sparse_step=1, **TEXT, **MOE,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        audio_token_id=ids("<|audio_pad|>"), image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        audio_start_token_id=ids("<|audio_start|>"), user_token_id=ids("<|im_start|>"))
    config.vision_start_token_id, config.vision_end_token_id = ids("<|vision_start|>"), ids("<|vision_end|>")
    config.audio_end_token_id = ids("<|audio_end|>")
    return _omni(config, tokenizer, Qwen3OmniMoeProcessor, Qwen3OmniMoeThinkerForConditionalGeneration,
                 "qwen3_omni_thinking")


def qwen2_audio():
    """Qwen2-Audio (Qwen/Qwen2-Audio-7B-Instruct) at toy size: a Whisper encoder (two convolutions, attention over its
    fixed window of 3000 frames, 30 s, then pooled 2:1: 25 soft tokens a second of 16 kHz audio) and a projector
    before Qwen2; no vision tower. Its audio token lives on the processor, not the tokenizer (as the checkpoint's);
    the template is the processor class's own (`qwen2_audio.jinja`)."""
    tokenizer = train_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>",
                                 "<|audio_eos|>"], eos="<|im_end|>", pad="<|endoftext|>")
    config = Qwen2AudioConfig(
        audio_config=dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                          d_model=32),
        text_config=dict(model_type="qwen2", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **TEXT),
        audio_token_id=tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tokenizer,
                                    chat_template=template("qwen2_audio"))
    model = Qwen2AudioForConditionalGeneration(config)
    _stop_on(model, *tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    return model, processor


def voxtral():
    """Voxtral (mistralai/Voxtral-Mini-3B-2507) at toy size: its encoder keeps the checkpoint's window (3000 frames,
    1500 positions, 375 soft tokens); Llama with room for clips of a few windows."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = convert_tekken_tokenizer(tekken_file(Path(folder) / "tekken.json"),
                                             chat_template=template("voxtral"))
    config = VoxtralConfig(
        audio_config=dict(num_mel_bins=128, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **TEXT | {"max_position_embeddings": 4096}),
        audio_token_id=tokenizer.convert_tokens_to_ids("[AUDIO]"))
    processor = VoxtralProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tokenizer)
    model = VoxtralForConditionalGeneration(config)
    _stop_on(model, tokenizer.eos_token_id)
    return model, processor


# the speaking parts of a full Qwen2.5-Omni checkpoint at toy size
TALKER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, embedding_size=TEXT["hidden_size"],
              rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]})
TOKEN2WAV = dict(dit_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ff_mult=1, emb_dim=16,
                                 head_dim=16, num_embeds=64, mel_dim=8, enc_emb_dim=8, enc_dim=8,
                                 enc_channels=[8, 8, 8, 8, 24], repeats=1, look_ahead_layers=[0],
                                 look_backward_layers=[0]),
                 bigvgan_config=dict(mel_dim=8, upsample_initial_channel=16, resblock_kernel_sizes=[3],
                                     resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[2],
                                     upsample_kernel_sizes=[4]))


def _whole(family, model_class, config_class, **speaking):
    """The thinker of `family` (the same weights) inside a whole checkpoint with the `speaking` parts' configs."""
    thinker, processor = family()
    model = model_class(config_class(thinker_config=thinker.config.to_dict(), **speaking))
    model.thinker = thinker
    model.generation_config.eos_token_id = thinker.generation_config.eos_token_id
    return model, processor


def qwen2_5_omni_full():
    return _whole(qwen2_5_omni, Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniConfig, talker_config=TALKER,
                  token2wav_config=TOKEN2WAV)


# the speaking parts of a full Qwen3-Omni checkpoint at toy size: the talker (a sparse decoder and its code
# predictor; the checkpoint's config names the merge size the talker's positions read, which its class leaves out)
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16)
QWEN3_TALKER = dict(text_config=dict(vocab_size=64, **SMALL, moe_intermediate_size=32, num_experts=2,
                                     num_experts_per_tok=1, shared_expert_intermediate_size=32,
                                     rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                      "mrope_interleaved": True}),
                    code_predictor_config=dict(vocab_size=64, **SMALL, num_code_groups=2), num_code_groups=2,
                    thinker_hidden_size=TEXT["hidden_size"], accept_hidden_layer=0, codec_eos_token_id=1,
                    codec_nothink_id=2, codec_think_bos_id=3, codec_think_eos_id=4, codec_pad_id=5, codec_bos_id=6,
                    spatial_merge_size=2)
CODE2WAV = dict(codebook_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                intermediate_size=64, num_quantizers=2, decoder_dim=32, upsample_rates=[2, 2], upsampling_ratios=[2],
                sliding_window=8)


def qwen3_omni_moe_full():
    return _whole(qwen3_omni_moe, Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeConfig,
                  talker_config=QWEN3_TALKER, code2wav_config=CODE2WAV)


FAMILIES = {"qwen3_5": qwen3_5, "qwen3_5_think": qwen3_5_think, "qwen3_vl_moe": qwen3_vl_moe,
            "qwen3_5_moe": qwen3_5_moe, "gemma4": gemma4, "gemma4_moe": gemma4_moe,
            "qwen2_5_omni": qwen2_5_omni, "qwen3_omni_moe": qwen3_omni_moe, "qwen2_audio": qwen2_audio,
            "voxtral": voxtral}
WHOLE = {"qwen2_5_omni_full": qwen2_5_omni_full, "qwen3_omni_moe_full": qwen3_omni_moe_full}


def save_tiny_vlm_2026(family: str, output_dir):
    return save_family(FAMILIES, family, output_dir)


if __name__ == "__main__":
    family_main(__doc__, FAMILIES | WHOLE)
