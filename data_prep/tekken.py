"""A tiny Tekken tokenizer file, as Mistral's checkpoints ship their tokenizers (`tekken.json`): read by transformers
(which converts it) for the tiny Voxtral (tiny_vlm_2026.py) and by mistral_common for the tokens it writes
(mistral_common_parity.py). No import beyond the standard library: it runs beside mistral_common alone."""

import base64
import json
from pathlib import Path

# Tekken's special tokens at their ids (mistral_common's SpecialTokens); the others are fillers, <SPECIAL_i>
TEKKEN_SPECIALS = {**dict(enumerate(["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                                     "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]",
                                     "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]",
                                     "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]"])),
                   24: "[AUDIO]", 25: "[BEGIN_AUDIO]", 34: "[TRANSCRIBE]"}
TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
                  r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def tekken_file(path, num_special=1000):
    """A Tekken tokenizer file (v7, as Voxtral's) of the 256 bytes (no merges) after `num_special` special tokens,
    with the audio settings mistral_common reads (16 kHz, 12.5 tokens a second, 30 s windows, 128 mel bins)."""
    vocab = [{"rank": byte, "token_bytes": base64.b64encode(bytes([byte])).decode(),
              "token_str": chr(byte) if 32 <= byte < 127 else None} for byte in range(256)]
    specials = [{"rank": i, "token_str": TEKKEN_SPECIALS.get(i, f"<SPECIAL_{i}>"), "is_control": True}
                for i in range(max(TEKKEN_SPECIALS) + 1)]
    Path(path).write_text(json.dumps({
        "config": {"pattern": TEKKEN_PATTERN, "num_vocab_tokens": 256, "default_vocab_size": num_special + 256,
                   "default_num_special_tokens": num_special, "version": "v7"},
        "vocab": vocab, "special_tokens": specials,
        "audio": {"sampling_rate": 16000, "frame_rate": 12.5, "chunk_length_s": 30.0,
                  "audio_encoding_config": {"num_mel_bins": 128, "hop_length": 160, "window_size": 400}}}))
    return path
