"""Templates with a think block, on the tiny Qwen3.5 (data_prep/tiny_vlm_2026.py), in process: its official
templates (nothink: Qwen3.5-2B and smaller; think: 4B and larger; Qwen3.6's) and TRL's training patches of them,
against TRL's own labels on the same rows (`DataCollatorForVisionLanguageModeling(assistant_only_loss=True)`)."""

import copy
from pathlib import Path

import pytest
import torch
import trl
from transformers import AutoModelForImageTextToText, AutoProcessor, pipeline
from trl.chat_template_utils import get_training_chat_template
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from helpers import chat_row, write_chat_parquet
from mmrecipes.benchmarks.scoring import reasoning_of, without_reasoning
from mmrecipes.config import parse_args
from mmrecipes.distributed import Ranks
from mmrecipes.vlm.arguments import ChatDataArgs, PromptDataArgs
from mmrecipes.vlm.model import evaluation
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.chat_data import encode_row
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.held_out import generation_prompts
from mmrecipes.vlm.rows.labels import AnswerLabeller, EarlierReasoningDropped, TemplateError
from mmrecipes.vlm.rows.prompts import DistillPreprocessor, PromptPreprocessor
from mmrecipes.vlm.rows.template_checks import _runs, check_template
from test_family_conformance import COLOURS, STEPS, colour_conversation, square, train

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
# (tiny family, official template): Qwen3.5-2B's, Qwen3.5-4B's, and Qwen3.6's (27B, 35B-A3B: think by default)
TEMPLATES = [("qwen3_5", "qwen3_5_nothink"), ("qwen3_5_think", "qwen3_5_think"), ("qwen3_5_think", "qwen3_6")]
# What each official template's generation prompt writes after `<|im_start|>assistant\n`, and TRL's patch marks
PROMPT_TAIL = {"qwen3_5_nothink": "<think>\n\n</think>\n\n", "qwen3_5_think": "<think>\n", "qwen3_6": "<think>\n"}


def text(words):
    return [{"type": "text", "text": words}]


ROWS = [  # (messages, images): one image turn; two turns over two images; two text-only turns
    ([{"role": "user", "content": [{"type": "image"}, *text("What colour is it?")]},
      {"role": "assistant", "content": text("red")}], [square("red")]),
    ([{"role": "user", "content": [{"type": "image"}, {"type": "image"}, *text("Which is first?")]},
      {"role": "assistant", "content": text("the blue one")},
      {"role": "user", "content": text("And the other?")},
      {"role": "assistant", "content": text("green")}], [square("blue"), square("green")]),
    ([{"role": "system", "content": text("Be brief.")},
      {"role": "user", "content": text("Name a colour.")},
      {"role": "assistant", "content": text("yellow")},
      {"role": "user", "content": text("Another?")},
      {"role": "assistant", "content": text("blue")}], []),
]


def runs(processor, input_ids, labels):
    return [processor.tokenizer.decode(input_ids[run]) for run in _runs(labels != -100)]


@pytest.mark.parametrize("family, template", TEMPLATES)
def test_targets_are_trls_assistant_tokens_less_the_generation_prompts_tail(tiny_vlms, family, template):
    """With TRL's training template (the one TRL itself swaps in for the official one) the input ids are TRL's and
    every answer is a target: TRL's masked tokens less what the generation prompt already wrote (the model is given
    it: the empty think block in nothink, `<think>\\n` in think) and less the new line after `<|im_end|>`. With the
    official template, which drops an earlier answer's think block once later turns follow, the last answer is
    the target, the same tokens; the earlier answers are context, and the log line says so. Before, both were
    refused before the first step ("start inside its generation prompt", "not a prefix"). TRL trains the empty
    think block (`--empty_think_block target`); by default (context) it is out of the targets, exactly: a thinking
    model tuned on plain answers learnt to close its block at once, to stop thinking."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms[family])
    processor = AutoProcessor.from_pretrained(tiny_vlms[family])
    if template == "qwen3_6":  # the tiny checkpoints carry Qwen3.5's; Qwen3.6 ships its own
        processor.chat_template = (TRL_TEMPLATES / "qwen3_6.jinja").read_text()
    assert processor.chat_template == (TRL_TEMPLATES / f"{template}.jinja").read_text()
    training = get_training_chat_template(processor)
    assert training == (TRL_TEMPLATES / f"{template}_training.jinja").read_text()
    trl_collator = DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True, chat_template=training)
    stops = stop_token_ids(model, processor)
    # TRL trains the empty think block: --empty_think_block target
    marked = AnswerLabeller(processor, stops, template=training, empty_think="target")
    official = AnswerLabeller(processor, stops, empty_think="target")
    kept_thinking = AnswerLabeller(processor, stops, template=training)  # the default, context
    block = kept_thinking.empty_think_block
    assert block == ("" if template == "qwen3_5_nothink" else "\n</think>\n\n")  # nothink: the prompt wrote it
    tail = PROMPT_TAIL[template]
    lead = tail.split("<think>")[1].replace("\n\n</think>\n\n", "")  # what is left of the block to write
    marked_line, official_line = check_template(marked, "trl"), check_template(official, family)
    assert "only the last answer" not in marked_line and "only the last answer of a conversation" in official_line
    for line in (marked_line, official_line):
        assert "ends each answer with <|im_end|>, a target" in line
        assert ("before each answer" in line) == (template != "qwen3_5_nothink")
    for messages, images in ROWS:
        expected = trl_collator([{"messages": copy.deepcopy(messages), "images": images}])
        trl_runs = runs(processor, expected["input_ids"][0], expected["labels"][0])
        assert len(trl_runs) == sum(message["role"] == "assistant" for message in messages)
        assert all(run.startswith(tail) and run.endswith("<|im_end|>\n") for run in trl_runs)
        targets = [run.removeprefix(tail).removesuffix("\n") for run in trl_runs]
        assert all(target.startswith(lead.strip("\n")) for target in targets)
        input_ids, labels, media = encode_row(marked, messages, images)
        assert torch.equal(input_ids, expected["input_ids"][0])
        assert runs(processor, input_ids, labels) == targets
        assert ("pixel_values" in media) == bool(images)
        input_ids, labels, _ = encode_row(official, messages, images)
        assert runs(processor, input_ids, labels) == targets[-1:]
        # context: the block exactly out of the targets, every other target token as TRL's
        input_ids, labels, _ = encode_row(kept_thinking, messages, images)
        assert torch.equal(input_ids, expected["input_ids"][0])
        assert runs(processor, input_ids, labels) == [target.removeprefix(block) for target in targets]
    context_line = check_template(kept_thinking, "trl")
    assert ("an empty think block: context, not a target" in context_line) == bool(block)



def test_the_template_line_shows_a_row_with_and_without_reasoning_labelled(tiny_vlms):
    """The log shows what the model learns: a question and answer labelled as a training row, targets in [[ ]], with
    and without reasoning; the empty think block outside the targets under the context policy, inside under target;
    a template that writes no reasoning (the tiny Llava's) says why a row with it is skipped."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms["qwen3_5_think"])
    processor = AutoProcessor.from_pretrained(tiny_vlms["qwen3_5_think"])
    stops = stop_token_ids(model, processor)
    prompt = "<|im_start|>user\\nWhat colour is it?<|im_end|>\\n<|im_start|>assistant\\n<think>\\n"
    reasoned = prompt + "[[The shape is red.\\n</think>\\n\\nred<|im_end|>]]\\n"
    for policy, plain in (("context", prompt + "\\n</think>\\n\\n[[red<|im_end|>]]\\n"),
                          ("target", prompt + "[[\\n</think>\\n\\nred<|im_end|>]]\\n")):
        line = check_template(AnswerLabeller(processor, stops, empty_think=policy), "qwen3_5_think")
        assert line.splitlines()[1:] == [f"  example without reasoning: {plain}",
                                         f"  example with reasoning: {reasoned}"], line
    no_think = AnswerLabeller(processor, stops, template_kwargs={"enable_thinking": False})
    reasoned = check_template(no_think, "qwen3_5_think").splitlines()[2]
    assert reasoned.startswith("  example with reasoning: skipped, counted as no_target ("), reasoned
    llava = AutoProcessor.from_pretrained(tiny_vlms["llava"])
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms["llava"])
    plain, reasoned = check_template(AnswerLabeller(llava, stop_token_ids(model, llava)), "llava").splitlines()[1:]
    assert plain == "  example without reasoning: USER: What colour is it? ASSISTANT:[[ red]] ", plain
    assert reasoned.startswith("  example with reasoning: skipped, counted as bad_row (the chat template does not "
                               "render reasoning_content"), reasoned

def test_markers_that_take_in_the_assistant_header_or_stop_in_the_prompt_are_refused(tiny_vlms):
    """Read from the prompt's end only where the marked text begins after the generation prompt's assistant
    header and goes past the prompt: TRL's training template with its markers moved before the header (the model
    would be taught the header it is given), or closed after the think block (no answer), is refused."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms["qwen3_5"])
    processor = AutoProcessor.from_pretrained(tiny_vlms["qwen3_5"])
    training = (TRL_TEMPLATES / "qwen3_5_nothink_training.jinja").read_text()
    header = "        {{- '<|im_start|>' + message.role + '\\n' }}\n        {%- generation %}\n"
    block = "        {{- '<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content }}\n"
    end = "        {%- endgeneration %}\n"
    assert header in training and block in training and training.count(end) == 1
    mistakes = {
        "header": training.replace(header, "        {%- generation %}\n" + header.splitlines(True)[0]),
        "block only": training.replace(end, "").replace(block, block.replace(
            " + content }}", " }}{%- endgeneration %}{{- content }}")),
    }
    for name, template in mistakes.items():
        labeller = AnswerLabeller(processor, stop_token_ids(model, processor), template=template)
        with pytest.raises(TemplateError, match="markers of assistant turn 1 start inside its generation prompt"):
            check_template(labeller, name)


def answers_after_thinking(output_dir) -> dict:
    """What the saved model answers to each colour's square through the pipeline, after its think block."""
    answer = pipeline("image-text-to-text", model=str(output_dir))
    said = {}
    for colour in COLOURS:
        chat = colour_conversation()
        chat[-1]["content"][0]["image"] = square(colour)
        output = answer(text=chat, return_full_text=False, generate_kwargs={"max_new_tokens": 8, "do_sample": False})
        said[colour] = output[0]["generated_text"].split("</think>")[-1].strip()
    return said


def test_qwen3_5_think_learns_the_colour_through_trls_training_template(tiny_vlms, tmp_path):
    """Qwen3.5 in think mode, trained through TRL's training template, saved with its official one: the pipeline's
    prompt opens a think block, the model closes it and names every colour. (The nothink template, trained as it
    is: test_family_conformance.py.)"""
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms["qwen3_5_think"])
    processor = AutoProcessor.from_pretrained(tiny_vlms["qwen3_5_think"])
    official, processor.chat_template = processor.chat_template, get_training_chat_template(processor)
    train(model, processor, model.parameters(), STEPS)
    processor.chat_template = official
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    assert answers_after_thinking(tmp_path) == {colour: colour for colour in COLOURS}


def test_reasoning_content_reaches_the_template_and_is_trained_or_the_row_says_why_not(tiny_vlms):
    """An assistant turn's `reasoning_content` (the transformers / OpenAI field Qwen3's templates read) was dropped
    when rows were read: the row trained the template's empty think block, the reasoning lost, silently. Now it is
    rendered and trained as the official template writes it; a template that never renders it skips the row as a
    bad_row saying so, and reasoning on a user's turn is a bad_row."""
    from mmrecipes.skips import Skip
    from mmrecipes.vlm.arguments import ChatDataArgs, VLMModelArgs
    from mmrecipes.vlm.model.parts import load_vlm
    from mmrecipes.vlm.rows.chat_data import ChatPreprocessor

    # as a datasets column fills the other turns: None or ""
    row = {"messages": [{"role": "user", "content": "What colour is a stop sign?", "reasoning_content": ""},
                        {"role": "assistant", "content": "red", "reasoning_content": "Stop signs are painted red."}]}
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms["qwen3_5_think"])
    processor = AutoProcessor.from_pretrained(tiny_vlms["qwen3_5_think"])
    reading = ChatPreprocessor(ChatDataArgs(), AnswerLabeller(processor, stop_token_ids(model, processor)), 512)
    (input_ids, labels, _), _ = reading.example(row)
    # the generation prompt wrote `<think>\n`: the reasoning, the block's end and the answer are the target
    assert runs(processor, input_ids, labels) == ["Stop signs are painted red.\n</think>\n\nred<|im_end|>"]
    llava, llava_processor = load_vlm(VLMModelArgs())
    plain = ChatPreprocessor(ChatDataArgs(), AnswerLabeller(llava_processor, stop_token_ids(llava, llava_processor)),
                             512)
    with pytest.raises(Skip, match="bad_row: the chat template does not render reasoning_content"):
        plain.example(row)
    # Reasoning inlined in the answer, as Qwen3's templates also read it: rendered and trained as reasoning_content
    inline = copy.deepcopy(row)
    inline["messages"][1] = {"role": "assistant", "content": "<think>\nStop signs are painted red.\n</think>\n\nred"}
    (inline_ids, inline_labels, _), _ = reading.example(inline)
    assert torch.equal(inline_ids, input_ids) and torch.equal(inline_labels, labels)
    # reasoning on a user's turn, an unclosed block (its reasoning would have no end), two reasonings: bad rows
    for turn, change, problem in [(0, {"reasoning_content": "I wonder."}, "reasoning_content on a user turn"),
                                  (1, {"content": "<think>\nStop signs are painted"},
                                   "an assistant turn opens <think> and never closes it"),
                                  (1, {"reasoning_content": "Red, I think."},
                                   "an assistant turn with both reasoning_content and an inline <think>")]:
        bad = copy.deepcopy(inline)
        bad["messages"][turn] |= change
        with pytest.raises(Skip, match=f"bad_row: {problem}"):
            reading.example(bad)


def test_the_format_reward_reads_the_turn_whose_think_block_the_prompt_opened(tiny_vlms):
    """Qwen3.5's think templates open `<think>` in the generation prompt, so every completion starts inside the
    block: the built-in format reward (TRL's `think_format_reward` too, TRL #6966) scored them all 0, whatever the
    model wrote. It reads the model's turn now: the completion after what the generation prompt wrote of it, given
    by the scorer the recipe builds with the labeller's generation prompt. A prompt that opens nothing changes
    nothing."""
    from trl.rewards import think_format_reward

    from mmrecipes.vlm.algorithms.rewards import RewardScorer, load_reward_funcs
    from mmrecipes.vlm.arguments import GRPOArgs, VLMModelArgs
    from mmrecipes.vlm.model.parts import load_vlm

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms["qwen3_5_think"])
    processor = AutoProcessor.from_pretrained(tiny_vlms["qwen3_5_think"])
    prompt = AnswerLabeller(processor, stop_token_ids(model, processor)).generation_prompt()
    assert prompt == "<|im_start|>assistant\n<think>\n"
    funcs = load_reward_funcs(["format"], GRPOArgs().format_pattern)
    completions = ["It is the colour of a stop sign.\n</think>\n\n<answer>red</answer>", "<answer>red</answer>",
                   "<think>twice</think> <answer>red</answer>"]
    ids = [[1]] * len(completions)
    assert RewardScorer(funcs, [1.0], generation_prompt=prompt)(None, completions, ids, {})[:, 0].tolist() == [
        1.0, 0.0, 1.0]
    assert RewardScorer(funcs, [1.0])(None, completions, ids, {})[:, 0].tolist() == [0.0, 0.0, 1.0]  # as before
    assert think_format_reward([[{"content": completions[0]}]]) == [0.0]
    llava, llava_processor = load_vlm(VLMModelArgs())
    plain = AnswerLabeller(llava_processor, stop_token_ids(llava, llava_processor)).generation_prompt()
    assert RewardScorer(funcs, [1.0], generation_prompt=plain)(None, completions, ids, {})[:, 0].tolist() == [
        0.0, 0.0, 1.0]


def test_chat_template_kwargs_reach_the_labels_and_the_prompts_and_a_key_never_read_is_refused(tiny_vlms):
    """--chat_template_kwargs '{"enable_thinking": false}' on Qwen3.5-4B's think template (before, no run could pass
    it): the training rows, the generation prompt and a GRPO prompt row are the template's own rendering with it
    (`apply_chat_template(..., enable_thinking=False)`, what TRL's GRPOTrainer renders with its
    `chat_template_kwargs`): the no-think prompt writes the closed empty block, which is context, and the answer is
    the target. A key the template never reads (a typo) is refused with the options it reads; a value that is not
    a mapping, or a key the recipe sets itself, when the flags are parsed."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms["qwen3_5_think"])
    processor = AutoProcessor.from_pretrained(tiny_vlms["qwen3_5_think"])
    stops = stop_token_ids(model, processor)
    (data_args,) = parse_args([PromptDataArgs], ["--chat_template_kwargs", '{"enable_thinking": false}'])
    no_think = AnswerLabeller(processor, stops, template_kwargs=data_args.chat_template_kwargs)
    thinking = AnswerLabeller(processor, stops)
    assert no_think.generation_prompt() == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert thinking.generation_prompt() == "<|im_start|>assistant\n<think>\n"
    line = check_template(no_think, "qwen3_5_think")
    assert 'rendered with {"enable_thinking": false} (--chat_template_kwargs)' in line
    messages, images = ROWS[0]
    input_ids, labels, _ = encode_row(no_think, messages, images)
    served = processor.apply_chat_template(messages, enable_thinking=False)
    assert processor.tokenizer.decode(input_ids).replace("<|image_pad|>", "") == served.replace("<|image_pad|>", "")
    assert runs(processor, input_ids, labels) == ["red<|im_end|>"]
    assert "<think>\n\n</think>\n\nred" in served
    reader = PromptPreprocessor(data_args, no_think, 256)
    (ids, *_), _ = reader.example({"prompt": "What colour is it?"})
    prompt = [{"role": "user", "content": [{"type": "text", "text": "What colour is it?"}]}]
    expected = processor.apply_chat_template(prompt, add_generation_prompt=True, enable_thinking=False)
    assert processor.tokenizer.decode(ids) == expected and expected.endswith("<think>\n\n</think>\n\n")
    assert processor.tokenizer.decode(PromptPreprocessor(PromptDataArgs(), thinking, 256).example(
        {"prompt": "What colour is it?"})[0][0]).endswith("assistant\n<think>\n")  # the old rendering
    # distillation's rows: the prompt both models continue, then the dataset's answer, the only target
    for labeller, prompt_tail in [(no_think, "assistant\n<think>\n\n</think>\n\n"), (thinking, "assistant\n<think>\n")]:
        (ids, labels, _, prompt_length, _), _ = DistillPreprocessor(data_args, labeller, 256).example(
            {"prompt": "What colour is it?", "solution": "red"})
        assert processor.tokenizer.decode(ids[:prompt_length]).endswith(prompt_tail)
        assert runs(processor, ids, labels) == ["red<|im_end|>"]
    with pytest.raises(ValueError, match=r"never reads enable_thinkng, so it changes nothing; the options it reads: "
                                         r".*enable_thinking"):
        AnswerLabeller(processor, stops, template_kwargs={"enable_thinkng": False})
    with pytest.raises(ValueError, match="the options it reads: none beyond the conversation"):
        AnswerLabeller(AutoProcessor.from_pretrained(tiny_vlms["llava"]), stops, template_kwargs={"x": 1})
    for value, problem in [("[1]", "list .* is not a mapping"), ('{"messages": []}', "messages is set by the recipe"),
                           ("{enable_thinking: false}", "not JSON")]:
        with pytest.raises(ValueError, match=f"--chat_template_kwargs: {problem}"):
            parse_args([PromptDataArgs], ["--chat_template_kwargs", value])


def reasoned(answer, reasoning=None):
    return {"role": "assistant", "content": text(answer)} | ({"reasoning_content": reasoning} if reasoning else {})


REASONED_ROWS = [  # single-turn with reasoning; two turns, both reasoned; mixed: plain then reasoned, and reversed
    ([{"role": "user", "content": [{"type": "image"}, *text("What colour is it?")]},
      reasoned("red", "The square is red.")], [square("red")]),
    ([{"role": "user", "content": [{"type": "image"}, {"type": "image"}, *text("Which is first?")]},
      reasoned("the blue one", "The left one is blue."),
      {"role": "user", "content": text("And the other?")},
      reasoned("green", "The right one is green.")], [square("blue"), square("green")]),
    ([{"role": "user", "content": text("Name a colour.")}, reasoned("yellow"),
      {"role": "user", "content": text("One of the sea?")}, reasoned("blue", "The sea looks blue.")], []),
    ([{"role": "user", "content": text("Name a colour.")}, reasoned("yellow", "Any will do."),
      {"role": "user", "content": text("Another?")}, reasoned("blue")], []),
]


@pytest.mark.parametrize("family, template", TEMPLATES[1:])
def test_every_turns_reasoning_trains_as_trls_training_template_and_preserve_thinking_writes_it(tiny_vlms, family,
                                                                                                template):
    """Multi-turn rows with reasoning on some turns (single-turn, multi-turn, mixed): with TRL's training template
    every answer is a target with its reasoning, equal to TRL's assistant masks less the generation prompt's tail;
    under the context policy a turn without reasoning loses exactly its empty think block. Qwen3.6's own template
    with `preserve_thinking` true writes every turn's reasoning as the training template does: the same ids and
    targets; false (its default) drops earlier turns' reasoning, so the last answer alone is the target. A key the
    template never reads (`preserve_thinking` on Qwen3.5's) is refused."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms[family])
    processor = AutoProcessor.from_pretrained(tiny_vlms[family])
    if template == "qwen3_6":
        processor.chat_template = (TRL_TEMPLATES / "qwen3_6.jinja").read_text()
    training = get_training_chat_template(processor)
    trl_collator = DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True, chat_template=training)
    stops = stop_token_ids(model, processor)
    marked = AnswerLabeller(processor, stops, template=training, empty_think="target")
    kept_thinking = AnswerLabeller(processor, stops, template=training)
    block, tail = kept_thinking.empty_think_block, PROMPT_TAIL[template]
    preserving = {preserve: AnswerLabeller(processor, stops, empty_think="target",
                                           template_kwargs={"preserve_thinking": preserve})
                  for preserve in (True, False) if template == "qwen3_6"}
    for messages, images in REASONED_ROWS:
        expected = trl_collator([{"messages": copy.deepcopy(messages), "images": images}])
        targets = [run.removeprefix(tail).removesuffix("\n")
                   for run in runs(processor, expected["input_ids"][0], expected["labels"][0])]
        answers = [message for message in messages if message["role"] == "assistant"]
        assert len(targets) == len(answers)
        for target, answer in zip(targets, answers):
            assert (answer.get("reasoning_content") or "") in target and target.endswith("<|im_end|>")
        input_ids, labels, _ = encode_row(marked, messages, images)
        assert torch.equal(input_ids, expected["input_ids"][0]) and runs(processor, input_ids, labels) == targets
        input_ids, labels, _ = encode_row(kept_thinking, messages, images)
        assert runs(processor, input_ids, labels) == [
            target if answer.get("reasoning_content") else target.removeprefix(block)
            for target, answer in zip(targets, answers)]
        for preserve, labeller in preserving.items():
            input_ids, labels, _ = encode_row(labeller, messages, images)
            assert runs(processor, input_ids, labels) == (targets if preserve else targets[-1:])
            assert torch.equal(input_ids, expected["input_ids"][0]) == (preserve or len(answers) == 1)
    if template == "qwen3_5_think":
        with pytest.raises(ValueError, match="the chat template never reads preserve_thinking"):
            AnswerLabeller(processor, stops, template_kwargs={"preserve_thinking": True})
        return
    # TRL's markers on a template that still drops earlier reasoning: the first answer would be trained without its
    # reasoning (before, only the last turn's reasoning was looked for, and such a row was labelled so, silently)
    keep = "        {{- '<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content }}\n"
    assert keep in training
    dropping = AnswerLabeller(processor, stops, template=training.replace(
        keep, "{%- if loop.index0 > ns.last_query_index %}" + keep + "{%- else %}{{- content }}{%- endif %}"))
    with pytest.raises(TemplateError, match="The chat template of dropping cannot train multi-turn reasoning: the "
                                            "chat template drops the reasoning of assistant turn 1 once later turns"):
        check_template(dropping, "dropping")
    with pytest.raises(EarlierReasoningDropped, match=r'\{"preserve_thinking": true\} in --chat_template_kwargs'):
        encode_row(dropping, *REASONED_ROWS[1])
    input_ids, labels, _ = encode_row(dropping, *REASONED_ROWS[2])  # no earlier reasoning to drop: both trained
    assert runs(processor, input_ids, labels) == ["yellow<|im_end|>", "The sea looks blue.\n</think>\n\nblue<|im_end|>"]


def test_rewards_get_the_parsed_turn_and_a_completion_cut_inside_its_reasoning_is_counted(tiny_vlms):
    """GRPO on Qwen3.5's think template (the prompt opens `<think>`): reward functions get TRL 1.16's parsed
    completion, `[{"role": "assistant", "reasoning_content": ..., "content": the answer}]`, so a TRL-style function
    reading `content` reads the answer and the built-in accuracy scores it (it read the reasoning and the answer as
    one string: 0); the built-in format still reads the whole turn after the prompt's `<think>`. A completion cut
    before its block closed is counted (`completions/truncated_in_reasoning_ratio`); one cut after it is not."""
    import torch

    from mmrecipes.vlm.algorithms.grpo import grpo_metrics
    from mmrecipes.vlm.algorithms.responses import ResponseFormat
    from mmrecipes.vlm.algorithms.rewards import RewardScorer, load_reward_funcs
    from mmrecipes.vlm.algorithms.sampling import Rollouts

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms["qwen3_5_think"])
    processor = AutoProcessor.from_pretrained(tiny_vlms["qwen3_5_think"])
    stops = stop_token_ids(model, processor)
    labeller = AnswerLabeller(processor, stops)
    question = [{"role": "user", "content": [{"type": "text", "text": "What colour is a stop sign?"}]}]
    prompt = {"prompt": question, "columns": {"solution": "red"}, "input_ids": torch.tensor(processor.tokenizer(
        processor.apply_chat_template(question, add_generation_prompt=True), add_special_tokens=False)["input_ids"])}
    turns = ["Stop signs are red.\n</think>\n\nred<|im_end|>", "Stop signs are", "Red.\n</think>\n\n"]
    ids = [processor.tokenizer(turn, add_special_tokens=False)["input_ids"] for turn in turns]
    seen = []

    def trl_style(completions, **kwargs):  # a TRL 1.16 reward function, unchanged
        seen.extend(completion[0] for completion in completions)
        return [float(completion[0]["content"] == "red") for completion in completions]

    funcs = load_reward_funcs(["accuracy", "format"], r"<think>.*?</think>\s*\w+") | {
        "trl_style": trl_style}
    scorer = RewardScorer(funcs, [1.0, 1.0, 1.0], generation_prompt=labeller.generation_prompt(),
                          responses=ResponseFormat.of(processor, stops))
    rollouts = Rollouts(completions=[(prompt, row) for row in ids], truncated=[False, True, True],
                        lengths=list(map(len, ids)))
    scores = rollouts.scores = scorer.score(rollouts, processor.tokenizer, stops)
    assert seen[0] == {"role": "assistant", "reasoning_content": "Stop signs are red.", "content": "red"}
    assert seen[1] == {"role": "assistant", "reasoning_content": "Stop signs are", "content": ""}
    assert scores[0].tolist() == [1.0, 1.0, 1.0] and scores[1].tolist() == [0.0, 0.0, 0.0]
    assert RewardScorer(funcs, [1.0] * 3, generation_prompt=labeller.generation_prompt()).score(
        rollouts, processor.tokenizer, stops)[0].tolist() == [0.0, 1.0, 0.0]  # before: the turn as one string
    assert rollouts.in_reasoning == [False, True, False]
    sums = rollouts.sums(scorer.total(scores), torch.zeros(3), scorer.take_failures(say=lambda line: None), funcs)
    metrics = grpo_metrics(sums | {"loss": 0, "normaliser": 1, "tokens_trained": 1} | {
        f"clip_{name}": 0 for name in ("low", "high", "region")}, funcs, 0.0)
    assert metrics["completions/truncated_in_reasoning_ratio"] == pytest.approx(1 / 3)


def test_held_out_answers_are_read_after_their_reasoning_and_generation_leaves_room_for_it(tiny_vlms, tmp_path):
    """A held-out row's answer is its text after the reasoning (given in `reasoning_content`, or inlined), and
    generation reads a thinking model's output as lmms-eval reads a benchmark answer: the text after the block the
    generation prompt opened. Where the rows reason, decoding runs long enough for the reasoning and says how many
    answers came after reasoning of the model's own."""
    write_chat_parquet(tmp_path / "held_out.parquet", [
        chat_row("What colour is it?", "red", square("red"), reasoning="The shape is red."),
        chat_row("What colour is it?", "<think>\nThe shape is blue.\n</think>\n\nblue", square("blue")),
        chat_row("What colour is it?", "green", square("green"))])
    processor = AutoProcessor.from_pretrained(tiny_vlms["qwen3_5_think"])
    args = ChatDataArgs(eval_dataset_name="parquet", eval_data_files=str(tmp_path / "held_out.parquet"),
                        eval_split="train")
    prompts = generation_prompts(args, processor, rows=8, ranks=Ranks())
    assert [held[1:] for held in prompts] == [("red", "The shape is red."), ("blue", "The shape is blue."),
                                              ("green", "")]
    assert processor.tokenizer.decode(prompts[0].prompt["input_ids"]).endswith("<|im_start|>assistant\n<think>\n")
    # what a thinking model writes after that prompt: the reasoning, or the block closed at once, or no block
    for written, read in (("The shape is red.\n</think>\n\nred", ("red", "The shape is red.")),
                          ("\n</think>\n\nred", ("red", "")), ("red", ("red", "")), (" red ", ("red", ""))):
        assert (without_reasoning(written), reasoning_of(written)) == read
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms["qwen3_5_think"])
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    decoded = []
    greedy = evaluation.greedy_tokens
    with pytest.MonkeyPatch.context() as patch:  # records how far each prompt is decoded
        patch.setattr(evaluation, "greedy_tokens", lambda *args: decoded.append(args[2]) or greedy(*args))
        scores = evaluation.evaluate_generation(VLMForTraining(model), prompts, collator([prompts[2].prompt]),
                                                collator, processor.tokenizer, stop_token_ids(model, processor), "cpu")
    # every prompt decoded as far, and far enough for the longest reasoned answer as the template writes it
    longest = max(len(processor.tokenizer(f"{held.reasoning}\n</think>\n\n{held.answer}<|im_end|>")["input_ids"])
                  for held in prompts)
    assert len(set(decoded)) == 1 and decoded[0] >= longest
    assert set(scores) == {"generated_accuracy", "eval_generated", "generated_with_reasoning"}
    assert scores["eval_generated"] == 3
    without = evaluation.evaluate_generation(VLMForTraining(model), prompts[2:], collator([prompts[2].prompt]),
                                             collator, processor.tokenizer, stop_token_ids(model, processor), "cpu")
    assert set(without) == {"generated_accuracy", "eval_generated"}  # rows that do not reason: no such share
