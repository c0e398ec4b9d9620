"""Write the tokens mistral_common itself gives for conversations that play clips, on the tiny Voxtral's Tekken file
(tests/fixtures/mistral_common_voxtral.json, which tests/test_audio_windows.py compares the recipes' Voxtral rows
against), and the chat template it writes for that tokenizer (data_prep/chat_templates/voxtral.jinja).

    python -m venv /tmp/mc && /tmp/mc/bin/pip install "mistral_common[audio]==1.13.1"
    /tmp/mc/bin/python data_prep/mistral_common_parity.py

mistral_common is Voxtral's own tokenizer: `VoxtralProcessor.apply_chat_template` hands it the conversation, and
transformers generates the checkpoint's Jinja template with it when converting a `tekken.json`. It does not install
beside this repository's packages: on Python 3.11 and 3.12 it requires numpy < 2.4 (here: 2.4), so the tests read
this file. A clip's samples do not change its tokens (its length does): the clips are noise of the lengths given.
"""

import json
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy
from mistral_common.integrations.chat_templates.chat_templates import convert_tokenizer_to_chat_template
from mistral_common.protocol.instruct.chunk import AudioChunk, TextChunk
from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.audio import Audio
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from tekken import tekken_file

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "tests" / "fixtures" / "mistral_common_voxtral.json"
TEMPLATE = ROOT / "data_prep" / "chat_templates" / "voxtral.jinja"
RATE = 16000
# in transformers' layout, each clip by its length in seconds
CONVERSATIONS = [
    [{"role": "user", "content": [{"type": "audio", "seconds": 1.5}, {"type": "text", "text": "How many beeps?"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "three"}]},
     {"role": "user", "content": [{"type": "text", "text": "And now?"}, {"type": "audio", "seconds": 45.0}]},
     {"role": "assistant", "content": [{"type": "text", "text": "two"}]}],
    # a prompt for generation: it ends with the question
    [{"role": "user", "content": [{"type": "audio", "seconds": 30.0}, {"type": "audio", "seconds": 0.1},
                                  {"type": "text", "text": "Which tone is higher?"}]}],
    [{"role": "user", "content": [{"type": "text", "text": "One, two?"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "three"}]}],
]


def chunk(part):
    if part["type"] == "text":
        return TextChunk(text=part["text"])
    noise = numpy.random.default_rng(0).uniform(-0.5, 0.5, round(part["seconds"] * RATE)).astype(numpy.float32)
    return AudioChunk.from_audio(Audio(audio_array=noise, sampling_rate=RATE, format="wav"))


def message(turn):
    kind = UserMessage if turn["role"] == "user" else AssistantMessage
    return kind(content=[chunk(part) for part in turn["content"]])


def main():
    with tempfile.TemporaryDirectory() as folder:
        path = tekken_file(Path(folder) / "tekken.json")
        # its validation asks a conversation to end with an answer (fine-tuning) or a question (generation)
        tokenizers = {role: MistralTokenizer.from_file(path, mode=mode) for role, mode in (
            ("assistant", ValidationMode.finetuning), ("user", ValidationMode.test))}
        TEMPLATE.write_text(convert_tokenizer_to_chat_template(path))
    tokens = [tokenizers[turns[-1]["role"]].encode_chat_completion(
        ChatCompletionRequest(messages=[message(turn) for turn in turns])).tokens for turns in CONVERSATIONS]
    OUTPUT.write_text(json.dumps({"mistral_common": version("mistral_common"), "sampling_rate": RATE,
                                  "conversations": CONVERSATIONS, "tokens": tokens}) + "\n")
    print(f"wrote {OUTPUT} ({[len(ids) for ids in tokens]} tokens) and {TEMPLATE}")


if __name__ == "__main__":
    main()
