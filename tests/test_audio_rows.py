"""Audio in rows: clips decoded with PyAV to one channel at the extractor's rate, every bad clip a reason to count
(mmrecipes.audio), and audio rows counted (audio) by every VLM recipe's reader instead of trained without
their sound, or with an `<audio>` placeholder trained as text."""

import io
import time
import wave

import av
import numpy
import pytest

from mmrecipes import audio
from mmrecipes.audio import decode_audio
from mmrecipes.skips import SKIPPED
from mmrecipes.vlm.algorithms.preference import PreferencePreprocessor
from mmrecipes.vlm.arguments import ChatDataArgs, VLMModelArgs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.rows import chat_data
from mmrecipes.vlm.rows.chat_data import ChatPreprocessor
from mmrecipes.vlm.rows.labels import AnswerLabeller
from mmrecipes.vlm.rows.prompts import PromptPreprocessor

RATE = 16000


def tone(seconds, rate, channels=1, frequency=440.0) -> numpy.ndarray:
    """(samples, channels) int16: a sine at half scale, channel c scaled by (c + 1) / channels."""
    wave_ = numpy.sin(2 * numpy.pi * frequency * numpy.arange(int(seconds * rate)) / rate) * 0.5
    return (wave_[:, None] * (numpy.arange(channels) + 1) / channels * 32767).astype(numpy.int16)


def wav_bytes(samples: numpy.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as file:
        file.setnchannels(samples.shape[1])
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(samples.tobytes())
    return buffer.getvalue()


def encoded(container_format, seconds=3.0, with_video=False) -> bytes:
    """A tone of `seconds` in `container_format` (AAC or MP3 audio), with a video stream before it if asked."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container_format) as container:
        if with_video:
            video = container.add_stream("mpeg4", rate=4)
            video.width = video.height = 32
            video.pix_fmt = "yuv420p"
        stream = container.add_stream("libmp3lame" if container_format == "mp3" else "aac", rate=RATE, layout="mono")
        frame = av.AudioFrame.from_ndarray(tone(seconds, RATE).T.astype(numpy.float32) / 32767, format="flt",
                                           layout="mono")
        frame.sample_rate = RATE
        codec_format = stream.codec_context.format.name
        for piece in av.AudioResampler(format=codec_format, layout="mono", rate=RATE).resample(frame):
            container.mux(stream.encode(piece))
        container.mux(stream.encode(None))
        if with_video:
            for index in range(int(seconds * 4)):
                picture = av.VideoFrame.from_ndarray(numpy.full((32, 32, 3), index * 20, numpy.uint8), format="rgb24")
                container.mux(video.encode(picture))
            container.mux(video.encode(None))
    return buffer.getvalue()


def test_a_clip_becomes_one_channel_at_the_extractors_rate():
    samples, problem = decode_audio(wav_bytes(tone(1.0, RATE), RATE), RATE, 30.0)
    assert problem is None and samples.dtype == numpy.float32
    numpy.testing.assert_allclose(samples, tone(1.0, RATE)[:, 0] / 32768, atol=1e-6)  # as written, full scale 1
    stereo, problem = decode_audio(wav_bytes(tone(1.0, 44100, channels=2), 44100), RATE, 30.0)
    # channels 0.5 and 1.0 of the tone: their mean, 0.75 of it, at 16 kHz
    assert problem is None and len(stereo) == RATE and abs(stereo.max() - 0.75 * 0.5) < 0.01


def test_a_96_khz_file_of_8_channels_is_averaged_not_summed_past_full_scale():
    """The old failure: FFmpeg's down-mix of 8 channels without named positions (PyAV's resampler asked for one
    channel) sums them past full scale."""
    raw = wav_bytes(tone(1.0, 96000, channels=8), 96000)
    samples, problem = decode_audio(raw, RATE, 30.0)
    # channels (c + 1) / 8 of the tone: their mean, 9/16 of it
    assert problem is None and len(samples) == RATE and abs(samples.max() - 9 / 16 * 0.5) < 0.01
    down_mix = av.AudioResampler(format="flt", layout="mono", rate=RATE)
    with av.open(io.BytesIO(raw)) as container:
        mixed = [piece.to_ndarray() for frame in container.decode(audio=0) for piece in down_mix.resample(frame)]
    assert numpy.concatenate(mixed, axis=1).max() > 1


@pytest.mark.parametrize("raw, problem", [
    (wav_bytes(numpy.zeros((0, 1), numpy.int16), RATE), "audio_empty"),
    (b"ID3\x03\x00\x00\x00\x00\x00\x00" + bytes(300), "audio_undecodable"),  # an MP3 whose header is broken
    (b"\xff\xfb" + bytes(40), "audio_undecodable"),
    ("no/such/clip.wav", "audio_undecodable"),
    (".", "audio_undecodable"),  # a folder: no file to open
], ids=["zero-length", "broken MP3 header", "MP3 frame header only", "missing file", "folder"])
def test_a_clip_that_gives_no_samples_is_a_reason(raw, problem):
    assert decode_audio(raw, RATE, 30.0) == (None, problem)


def test_a_2_hour_file_is_too_long_from_its_header_before_any_sample_is_decoded(tmp_path):
    """A WAV header of 2 hours at 16 kHz over 230 MB of (sparse) silence: refused in milliseconds."""
    path = tmp_path / "two_hours.wav"
    with wave.open(str(path), "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(RATE)
        file.setnframes(2 * 3600 * RATE)  # the header's length; the samples below are a hole in the file
    with open(path, "r+b") as file:
        file.truncate(44 + 2 * 3600 * RATE * 2)
    started = time.perf_counter()
    assert decode_audio(str(path), RATE, 600.0) == (None, "audio_too_long")
    assert time.perf_counter() - started < 1


def test_without_a_length_in_the_header_decoding_stops_past_the_limit(monkeypatch):
    raw = encoded("mp3", seconds=3.0)
    assert len(decode_audio(raw, RATE, 30.0)[0]) >= 3 * RATE
    monkeypatch.setattr(audio, "stream_seconds", lambda container, stream: None)
    decoded = []
    original = av.container.InputContainer.decode
    monkeypatch.setattr(av.container.InputContainer, "decode",
                        lambda self, *args: (decoded.append(frame) or frame for frame in original(self, *args)))
    assert decode_audio(raw, RATE, 1.0) == (None, "audio_too_long")
    assert RATE < sum(frame.samples for frame in decoded) < 1.1 * RATE  # stopped one frame past 1 s, not at 3 s


def test_a_videos_audio_track_is_a_clip_and_a_video_without_one_is_a_reason():
    samples, problem = decode_audio(encoded("mp4", seconds=2.0, with_video=True), RATE, 30.0)
    assert problem is None and 2 * RATE <= len(samples) <= 2 * RATE + 2048  # AAC pads up to 2 frames of 1024
    silent = io.BytesIO()
    with av.open(silent, "w", format="mp4") as container:
        video = container.add_stream("mpeg4", rate=4)
        video.width = video.height = 32
        container.mux(video.encode(av.VideoFrame.from_ndarray(numpy.zeros((32, 32, 3), numpy.uint8), format="rgb24")))
        container.mux(video.encode(None))
    assert decode_audio(silent.getvalue(), RATE, 30.0) == (None, "audio_undecodable")


@pytest.fixture(scope="module")
def labeller():
    model, processor = load_vlm(VLMModelArgs())
    return AnswerLabeller(processor, stop_token_ids(model, processor))


QUESTION, ANSWER = "What is said?", "hello"
AUDIO_ROWS = {  # every way a row holds audio
    "LLaMA-Factory": {"messages": [{"role": "user", "content": f"<audio>{QUESTION}"},
                                   {"role": "assistant", "content": ANSWER}], "audios": ["a.wav"]},
    "ms-swift, no placeholder": {"messages": [{"role": "user", "content": QUESTION},
                                              {"role": "assistant", "content": ANSWER}], "audios": ["a.wav"]},
    "content part": {"messages": [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": QUESTION}]},
                                  {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}],
                     "audio": "a.wav"},
    "LLaVA placeholder": {"conversations": [{"from": "human", "value": f"<audio>\n{QUESTION}"},
                                            {"from": "gpt", "value": ANSWER}]},
}
TEXT_ROW = {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]}


def preprocessed(preprocessor, rows):
    columns = sorted({column for row in rows for column in row} | set(preprocessor.COLUMNS))
    return preprocessor({column: [row.get(column) for row in rows] for column in columns})


def test_every_recipes_reader_counts_audio_rows_and_without_the_count_they_train_as_text(labeller, caplog,
                                                                                         monkeypatch):
    args = ChatDataArgs(max_length=256)
    out = preprocessed(ChatPreprocessor(args, labeller, 256), [*AUDIO_ROWS.values(), TEXT_ROW])
    assert len(out["input_ids"]) == 1 and out[SKIPPED][0]["audio"] == len(AUDIO_ROWS)
    assert caplog.text.count("skipping audio rows (counted as audio)") == 1  # said once
    # DPO (both sides), GRPO and distillation prompts read the same rows
    pairs = [{"prompt": f"<audio>{QUESTION}", "chosen": ANSWER, "rejected": "bye"},
             {"prompt": QUESTION, "chosen": ANSWER, "rejected": "bye", "audios": ["a.wav"]},
             {"prompt": QUESTION, "chosen": ANSWER, "rejected": "bye"}]
    out = preprocessed(PreferencePreprocessor(args, labeller, 256), pairs)
    assert len(out["chosen"]) == 1 and out[SKIPPED][0]["audio"] == 2
    out = preprocessed(PromptPreprocessor(args, labeller, 256), [*AUDIO_ROWS.values(), TEXT_ROW])
    assert len(out["input_ids"]) == 1 and out[SKIPPED][0]["audio"] == len(AUDIO_ROWS)
    # the old failure: without the count every row trains, its answer learnt from the question alone (no audio
    # reaches the model: its inputs are the text's)
    monkeypatch.setattr(chat_data, "media_not_taken", lambda *args, **kwargs: None)
    out = preprocessed(ChatPreprocessor(args, labeller, 256), list(AUDIO_ROWS.values()))
    assert len(out["input_ids"]) == len(AUDIO_ROWS) and not any(out["media_inputs"])
