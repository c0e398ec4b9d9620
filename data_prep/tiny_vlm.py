"""Tiny checkpoints of the image-text-to-text families people fine-tune, saved in their hub layout.

    python data_prep/tiny_vlm.py --family qwen2_5_vl --output_dir /tmp/tiny-qwen2_5_vl
    accelerate launch recipes/vlm_finetune.py --model_name_or_path /tmp/tiny-qwen2_5_vl

Each is the family's model class built from its transformers config at toy size (random weights),
its own image processor and processor classes, a byte-level BPE tokenizer trained on the embedded
conversations with the family's special tokens, and the family's official chat template copied
verbatim (chat_templates/, sources in chat_templates/README.md). `save_pretrained` writes what the
hub repo holds, so the recipe loads it through the Auto classes as it would the real checkpoint.
Vision and text widths differ on purpose, as in every real checkpoint. The test suite builds its
fixtures with `save_tiny_vlm`; nothing here is used by the recipes.
"""

import argparse
from pathlib import Path

import datasets
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    CLIPImageProcessor,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessor,
    Gemma3Processor,
    GotOcr2ImageProcessor,
    Idefics2Config,
    Idefics2ForConditionalGeneration,
    Idefics2ImageProcessor,
    Idefics2Processor,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessor,
    Idefics3Processor,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLProcessor,
    InternVLVideoProcessor,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessor,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
    LlavaProcessor,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PaliGemmaConfig,
    PaliGemmaForConditionalGeneration,
    PaliGemmaProcessor,
    PixtralImageProcessor,
    PixtralProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
    SiglipImageProcessor,
)

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
IMAGE_SIZE = 32  # the embedded shapes images
VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2)
TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=2, max_position_embeddings=512)
QWEN_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
               "<|video_pad|>"]


def train_tokenizer(special_tokens, *, eos, pad, bos=None, vocab_size=384, **extra):
    """A byte-level BPE on the embedded conversations; the family's special tokens first (ids 0...)."""
    texts = _chat_texts()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=[AddedToken(t, special=True) for t in special_tokens],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, pad_token=pad,
                                   model_max_length=512, **extra)


def train_sentencepiece_style_tokenizer(special_tokens, vocab_size=384):
    """A BPE with Llama/Mistral SentencePiece's splitting: spaces as '▁' on the word that follows, every
    digit a token of its own (so ' 3' is '▁' then '3'), `<s>` added in front; the special tokens first."""
    texts = _chat_texts()
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(prepend_scheme="first"),
                                                       pre_tokenizers.Digits(individual_digits=True)])
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=[AddedToken(t, special=True) for t in special_tokens])
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=512)


def _chat_texts():
    files = [str(ROOT / f"data/vlm_shapes/{name}/train-*.parquet") for name in ("image_chat", "text_chat")]
    rows = datasets.load_dataset("parquet", data_files=files, split="train")
    texts = [part["text"] for row in rows.select_columns(["messages"]) for message in row["messages"]
             for part in message["content"] if part["text"]]
    return texts + ["system", "user", "assistant", "model", "You are a helpful assistant.", "User:", "Assistant:",
                    "[INST]", "[/INST]", "0 1 2 3 4 5 6 7 8 9"]


def template(name):
    return (TEMPLATES / f"{name}.jinja").read_text()


def _stop_on(model, *tokens):
    """generation_config: stop at the family's end-of-turn token(s), pad with the tokenizer's pad."""
    model.generation_config.eos_token_id = list(tokens) if len(tokens) > 1 else tokens[0]


def llava():
    """Llava-1.5 (llava-hf/llava-1.5-7b-hf's chat template) on the embedded chat tokenizer."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(ROOT / "data" / "vlm_tokenizer")
    vision = dict(model_type="clip_vision_model", image_size=IMAGE_SIZE, patch_size=8, **VISION)
    text = dict(model_type="llama", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **TEXT)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                         vision_feature_select_strategy="default")
    image_processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                         crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=template("llava"))
    model = LlavaForConditionalGeneration(config)
    _stop_on(model, tokenizer.eos_token_id)
    return model, processor


def llava_next():
    """LLaVA-NeXT (llava-hf/llava-v1.6-mistral-7b-hf's chat template) on a Mistral-style tokenizer: its
    template puts a space between `[/INST]` and the answer, which this tokenizer splits off before a digit."""
    tokenizer = train_sentencepiece_style_tokenizer(["<unk>", "<s>", "</s>", "<image>", "<pad>"])
    vision = dict(model_type="clip_vision_model", image_size=IMAGE_SIZE, patch_size=8, **VISION)
    text = dict(model_type="mistral", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **TEXT)
    pinpoints = [[IMAGE_SIZE, IMAGE_SIZE], [IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE]]
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_grid_pinpoints=pinpoints,
                             image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                             vision_feature_select_strategy="default", vision_feature_layer=-2)
    size = {"shortest_edge": IMAGE_SIZE}
    image_processor = LlavaNextImageProcessor(size=size, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                              image_grid_pinpoints=pinpoints)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=template("llava_next"))
    model = LlavaNextForConditionalGeneration(config)
    _stop_on(model, tokenizer.eos_token_id)
    return model, processor


def idefics2():
    """Idefics2 (HuggingFaceM4/idefics2-8b-chatty's chat template): a perceiver connector, and a processor that
    expands `<image>` itself without reporting where."""
    tokenizer = train_sentencepiece_style_tokenizer(["<unk>", "<s>", "</s>", "<pad>", "<fake_token_around_image>",
                                                     "<image>", "<end_of_utterance>"])
    ids = tokenizer.convert_tokens_to_ids
    text = dict(model_type="mistral", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **TEXT)
    config = Idefics2Config(
        vision_config=dict(image_size=IMAGE_SIZE, patch_size=8, **VISION), text_config=text,
        perceiver_config=dict(hidden_size=TEXT["hidden_size"], resampler_n_latents=4, resampler_depth=1,
                              resampler_n_heads=2, resampler_head_dim=16, num_key_value_heads=1),
        image_token_id=ids("<image>"))
    image_processor = Idefics2ImageProcessor(size={"shortest_edge": IMAGE_SIZE, "longest_edge": IMAGE_SIZE},
                                             do_image_splitting=False)
    processor = Idefics2Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=template("idefics2"))
    model = Idefics2ForConditionalGeneration(config)
    _stop_on(model, ids("<end_of_utterance>"), tokenizer.eos_token_id)
    return model, processor


def internvl3():
    """InternVL3 (OpenGVLab/InternVL3-*-hf's chat template): sizes as lists in its vision config, pixel shuffle."""
    tokenizer = train_tokenizer(QWEN_TOKENS[:3] + ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"], eos="<|im_end|>",
                                pad="<|endoftext|>",
                                extra_special_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                                                      "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"})
    ids = tokenizer.convert_tokens_to_ids
    config = InternVLConfig(
        vision_config=dict(image_size=[IMAGE_SIZE, IMAGE_SIZE], patch_size=[8, 8], **VISION),
        text_config=dict(model_type="qwen2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **TEXT),
        image_token_id=ids("<IMG_CONTEXT>"), image_seq_length=4, downsample_ratio=0.5)
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    processor = InternVLProcessor(image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=False),
                                  tokenizer=tokenizer, video_processor=InternVLVideoProcessor(size=size),
                                  image_seq_length=4, chat_template=template("internvl3"))
    model = InternVLForConditionalGeneration(config)
    _stop_on(model, ids("<|im_end|>"), ids("<|endoftext|>"))
    return model, processor


def mistral3():
    """Mistral Small 3.1 (mistralai/Mistral-Small-3.1-24B-Instruct-2503's chat template): a Pixtral tower whose
    patches are merged 2 x 2, `[IMG]` rows closed by `[IMG_BREAK]` and `[IMG_END]`."""
    tokenizer = train_tokenizer(["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                 "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"], bos="<s>", eos="</s>",
                                pad="<pad>", unk_token="<unk>")
    ids = tokenizer.convert_tokens_to_ids
    config = Mistral3Config(
        vision_config=dict(model_type="pixtral", image_size=IMAGE_SIZE, patch_size=8, head_dim=16, **VISION),
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **TEXT),
        image_token_index=ids("[IMG]"), spatial_merge_size=2)
    image_processor = PixtralImageProcessor(size={"longest_edge": IMAGE_SIZE}, patch_size=8)
    processor = PixtralProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                 spatial_merge_size=2, chat_template=template("mistral3"))
    model = Mistral3ForConditionalGeneration(config)
    _stop_on(model, tokenizer.eos_token_id)
    return model, processor


def paligemma2():
    """PaliGemma 2 (google/paligemma2-3b-pt-224's layout): a Gemma 2 LM, no chat template (it ships none: a
    prefix-LM, image and prompt attended both ways, the answer as the suffix). The recipe refuses it."""
    tokenizer = train_tokenizer(["<pad>", "<eos>", "<bos>", "<image>"], bos="<bos>", eos="<eos>", pad="<pad>",
                                extra_special_tokens={"image_token": "<image>"})
    image_processor = SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    image_processor.image_seq_length = (IMAGE_SIZE // 8) ** 2
    config = PaliGemmaConfig(
        vision_config=dict(model_type="siglip_vision_model", image_size=IMAGE_SIZE, patch_size=8,
                           projection_dim=TEXT["hidden_size"], **VISION),
        text_config=dict(model_type="gemma2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **TEXT),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer)
    model = PaliGemmaForConditionalGeneration(config)
    _stop_on(model, tokenizer.eos_token_id)
    return model, processor


def _qwen(classes, template_name, vision, rope, text=None, added_tokens=(), **config):
    """A Qwen-VL family: mRoPE over a 4-px patch grid merged 2 x 2, the ChatML special tokens; `text`: text config
    settings over `TEXT`'s; `added_tokens`: tokens of the vocabulary that are not special (Qwen3.5's `<think>`)."""
    config_class, model_class, processor_class, video_processor_class = classes
    tokenizer = train_tokenizer(QWEN_TOKENS, eos="<|im_end|>", pad="<|endoftext|>")
    tokenizer.add_tokens(list(added_tokens))
    ids = tokenizer.convert_tokens_to_ids
    config = config_class(
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": TEXT["hidden_size"],
                       **vision},
        text_config=dict(vocab_size=len(tokenizer), rope_parameters={"rope_type": "default", **rope},
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, **(TEXT | (text or {}))),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **config)
    pixels = dict(patch_size=4, merge_size=2, temporal_patch_size=2,
                  size={"shortest_edge": 8 * 8, "longest_edge": 64 * 64})
    processor = processor_class(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer,
                                video_processor=video_processor_class(**pixels), chat_template=template(template_name))
    model = model_class(config)
    _stop_on(model, ids("<|im_end|>"), ids("<|endoftext|>"))
    return model, processor


def qwen2_vl():
    """Qwen2-VL (Qwen/Qwen2-VL-7B-Instruct's chat template, the one Qwen2.5-VL kept)."""
    return _qwen((Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor, Qwen2VLVideoProcessor),
                 "qwen2_5_vl", vision=dict(embed_dim=32, mlp_ratio=2, hidden_size=TEXT["hidden_size"]),
                 rope=dict(mrope_section=[2, 3, 3]))


def qwen2_5_vl():
    """Qwen2.5-VL (Qwen/Qwen2.5-VL-7B-Instruct's chat template), embeddings tied as in the 3B checkpoint."""
    return _qwen((Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2VLVideoProcessor),
                 "qwen2_5_vl", vision=dict(window_size=16, fullatt_block_indexes=[1]),
                 rope=dict(mrope_section=[2, 3, 3]),
                 tie_word_embeddings=True)


def qwen3_vl():
    """Qwen3-VL (Qwen/Qwen3-VL-8B-Instruct's chat template), with one deepstack merger."""
    return _qwen((Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor),
                 "qwen3_vl", vision=dict(num_position_embeddings=64, deepstack_visual_indexes=[0]),
                 rope=dict(mrope_section=[2, 3, 3], mrope_interleaved=True))


def idefics3():
    """SmolVLM-Instruct (HuggingFaceTB/SmolVLM-Instruct's chat template): Idefics3 with image splitting."""
    grid = [f"<row_{row}_col_{col}>" for row in range(1, 5) for col in range(1, 5)]
    tokenizer = train_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<end_of_utterance>", "<image>",
                                 "<fake_token_around_image>", "<global-img>", *grid],
                                bos="<|im_start|>", eos="<end_of_utterance>", pad="<|im_end|>")
    ids = tokenizer.convert_tokens_to_ids
    config = Idefics3Config(
        vision_config=dict(image_size=IMAGE_SIZE, patch_size=8, **VISION),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **TEXT),
        image_token_id=ids("<image>"), scale_factor=2, pad_token_id=tokenizer.pad_token_id)
    # 64 px longest edge, 32 px tiles: a shapes image becomes 2 x 2 tiles plus the global image.
    image_processor = Idefics3ImageProcessor(size={"longest_edge": 2 * IMAGE_SIZE},
                                             max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=True)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=template("smolvlm"))
    model = Idefics3ForConditionalGeneration(config)
    _stop_on(model, ids("<end_of_utterance>"))
    return model, processor


def gemma3():
    """Gemma 3 (google/gemma-3-4b-it's chat template)."""
    tokenizer = train_tokenizer(["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                                 "<end_of_image>", "<image_soft_token>"], bos="<bos>", eos="<eos>", pad="<pad>",
                                extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                      "image_token": "<image_soft_token>"})
    ids = tokenizer.convert_tokens_to_ids
    config = Gemma3Config(
        vision_config=dict(model_type="siglip_vision_model", image_size=IMAGE_SIZE, patch_size=8, vision_use_head=False,
                           **VISION),
        text_config=dict(vocab_size=len(tokenizer), sliding_window=64,
                         layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **TEXT),
        mm_tokens_per_image=4, boi_token_index=ids("<start_of_image>"), eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"))
    image_processor = Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4,
                                chat_template=template("gemma3"))
    model = Gemma3ForConditionalGeneration(config)
    _stop_on(model, ids("<eos>"), ids("<end_of_turn>"))
    return model, processor


def llava_onevision():
    """LLaVA-OneVision (llava-hf/llava-onevision-qwen2-*-ov-hf's chat template): anyres tiles."""
    tokenizer = train_tokenizer(QWEN_TOKENS[:3] + ["<image>", "<video>"], eos="<|im_end|>", pad="<|endoftext|>")
    ids = tokenizer.convert_tokens_to_ids
    pinpoints = [[IMAGE_SIZE, IMAGE_SIZE], [IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE],
                 [2 * IMAGE_SIZE, 2 * IMAGE_SIZE]]
    config = LlavaOnevisionConfig(
        vision_config=dict(model_type="siglip_vision_model", image_size=IMAGE_SIZE, patch_size=8, vision_use_head=False,
                           **VISION),
        text_config=dict(model_type="qwen2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **TEXT),
        image_token_index=ids("<image>"), video_token_index=ids("<video>"), image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full", vision_feature_layer=-1)
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=pinpoints),
        video_processor=LlavaOnevisionVideoProcessor(size=size), tokenizer=tokenizer,
        num_image_tokens=(IMAGE_SIZE // 8) ** 2, vision_feature_select_strategy="full",
        chat_template=template("llava_onevision"))
    model = LlavaOnevisionForConditionalGeneration(config)
    _stop_on(model, ids("<|im_end|>"), ids("<|endoftext|>"))
    return model, processor


FAMILIES = {"llava": llava, "llava_next": llava_next, "qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_5_vl,
            "qwen3_vl": qwen3_vl, "internvl3": internvl3, "idefics2": idefics2, "idefics3": idefics3, "gemma3": gemma3,
            "llava_onevision": llava_onevision, "mistral3": mistral3, "paligemma2": paligemma2}


def save_tiny_vlm(family: str, output_dir) -> Path:
    return save_family(FAMILIES, family, output_dir)


def save_family(families: dict, family: str, output_dir) -> Path:
    """Build `families[family]()` (the same weights every time: seeded) and `save_pretrained` what it returns, the
    model and its processor (or tokenizer), to `output_dir`."""
    torch.manual_seed(0)
    model, processor = families[family]()
    model.save_pretrained(output_dir)
    processor.save_pretrained(output_dir)
    return Path(output_dir)


def family_main(description: str, families: dict):
    """The command line of a tiny-checkpoint script: --family, --output_dir."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(families), required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    print(f"wrote {save_family(families, args.family, args.output_dir)}")


if __name__ == "__main__":
    family_main(__doc__, FAMILIES)
