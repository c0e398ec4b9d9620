"""Tiny checkpoints of the language models people build a VLM on, saved in their hub layout.

    python data_prep/tiny_language_models.py --family qwen3 --output_dir /tmp/tiny-qwen3
    accelerate launch recipes/vlm_finetune.py --vision_model_name_or_path outputs/clip_pretrain \\
        --language_model_name_or_path /tmp/tiny-qwen3

Each is the family's causal LM class built from its transformers config at toy size (random weights), with the
family's own tokenizer class and pipeline (normaliser, pre-tokeniser, decoder, special tokens, the BOS it adds or
not) trained as BPE on the embedded conversations, its hub generation config's stop tokens, and its official chat
template copied verbatim (chat_templates/, sources in chat_templates/README.md):

- `llama3`: Llama 3.2 Instruct (1B/3B: tied embeddings). Its tokenizer is a plain `PreTrainedTokenizerFast` (the
  hub's `tokenizer_class`) with Llama 3's split pattern, `<|begin_of_text|>` added in front, no pad token. Its
  template writes today's date into the system turn and takes `content` as a string.
- `qwen3`: Qwen3 (8B and up: untied), `Qwen2Tokenizer`, the vocabulary padded to a multiple of 128 rows as Qwen's
  checkpoints are. Its template reads `content` as a string and writes an empty think block before the last answer.
- `gemma3_text`: Gemma 3 text (1B: tied embeddings scaled by sqrt(width)), `GemmaTokenizer` with byte fallback and
  `<bos>` added in front; the template of every Gemma 3 checkpoint.
- `phi3_5`: Phi-3.5-mini (untied), `LlamaTokenizer` with byte fallback and `<s>` added in front, stopping at `<|end|>`,
  `<|assistant|>` or `<|endoftext|>` as its generation config does. Its template ends a rendering without a generation
  prompt with the end-of-text token.

The test suite builds its fixtures with `save_tiny_language_model`; nothing here is used by the recipes.
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaTokenizer,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tiny_vlm import _chat_texts, family_main, save_family, template

SIZE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512)
VOCAB = 400  # not a multiple of 128: Qwen3's embedding rows are padded past it
# Llama 3's pre-tokeniser split (its tokenizer.json): contractions, words, 1-3 digits, punctuation, spaces
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _retrained(tokenizer_class, special_tokens, **kwargs):
    """`tokenizer_class` with a BPE vocabulary trained on the embedded conversations through the class's own
    pipeline, then rebuilt from that vocabulary and its merges as the class builds a hub checkpoint's."""
    byte_fallback = kwargs.pop("byte_fallback", False)
    empty = tokenizer_class(**kwargs)
    trained = empty.train_new_from_iterator(_chat_texts(), VOCAB, new_special_tokens=special_tokens)
    model = json.loads(trained.backend_tokenizer.to_str())["model"]
    vocab = model["vocab"]
    if byte_fallback:  # SentencePiece's <0x00>...<0xFF>: no character is ever unknown
        vocab |= {f"<0x{byte:02X}>": len(vocab) + byte for byte in range(256)}
    tokenizer = tokenizer_class(vocab=vocab, merges=[tuple(merge) for merge in model["merges"]], **kwargs)
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in special_tokens],
                         special_tokens=True)
    return tokenizer


def _stopping(model):
    """The model with its hub generation_config.json's stop tokens (the config's eos ids)."""
    model.generation_config.eos_token_id = model.config.eos_token_id
    return model


def llama3():
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                "<|eot_id|>", "<|python_tag|>"]
    bpe = Tokenizer(models.BPE(ignore_merges=True))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_chat_texts(), trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[AddedToken(token, special=True) for token in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bpe.token_to_id("<|begin_of_text|>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                        chat_template=template("llama3"))
    ids = tokenizer.convert_tokens_to_ids
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=ids("<|begin_of_text|>"),
                         eos_token_id=[ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>")],
                         tie_word_embeddings=True, **SIZE)
    return _stopping(LlamaForCausalLM(config)), tokenizer


def qwen3():
    tokenizer = _retrained(Qwen2Tokenizer, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"],
                           eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = template("qwen3")
    ids = tokenizer.convert_tokens_to_ids
    rows = -(-len(tokenizer) // 128) * 128  # Qwen's embedding matrices are padded past the tokenizer
    config = Qwen3Config(vocab_size=rows, eos_token_id=[ids("<|im_end|>"), ids("<|endoftext|>")],
                         pad_token_id=ids("<|endoftext|>"), tie_word_embeddings=False, **SIZE)
    return _stopping(Qwen3ForCausalLM(config)), tokenizer


def gemma3_text():
    tokenizer = _retrained(GemmaTokenizer, ["<start_of_turn>", "<end_of_turn>"], add_bos_token=True,
                           byte_fallback=True)
    tokenizer.chat_template = template("gemma3")
    ids = tokenizer.convert_tokens_to_ids
    config = Gemma3TextConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=[ids("<eos>"), ids("<end_of_turn>")],
                              sliding_window=64, query_pre_attn_scalar=16, **SIZE)
    return _stopping(Gemma3ForCausalLM(config)), tokenizer


def phi3_5():
    specials = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]
    tokenizer = _retrained(LlamaTokenizer, specials, add_bos_token=True, byte_fallback=True, eos_token="<|endoftext|>",
                           pad_token="<|endoftext|>")
    tokenizer.chat_template = template("phi3_5")
    ids = tokenizer.convert_tokens_to_ids
    config = Phi3Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                        pad_token_id=ids("<|endoftext|>"), tie_word_embeddings=False,
                        eos_token_id=[ids("<|end|>"), ids("<|assistant|>"), ids("<|endoftext|>")], **SIZE)
    return _stopping(Phi3ForCausalLM(config)), tokenizer


FAMILIES = {"llama3": llama3, "qwen3": qwen3, "gemma3_text": gemma3_text, "phi3_5": phi3_5}


def save_tiny_language_model(family: str, output_dir) -> Path:
    return save_family(FAMILIES, family, output_dir)


if __name__ == "__main__":
    family_main(__doc__, FAMILIES)
