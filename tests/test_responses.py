"""A model's turn read into reasoning, answer and tool calls (mmrecipes.vlm.algorithms.responses), in process: the
response template found by rendering each tiny family's official template (copied verbatim) reads the same
completions as TRL 1.16's `parse_response` does with TRL's own table of response templates (`add_response_schema`):
Qwen3.5 in both modes (tags per argument), Gemma 4 (its thought channel, `call:name{...}` with its own quotes),
Qwen3-VL (JSON between two marks)."""

import pytest
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl.chat_template_utils import add_response_schema, parse_response

from mmrecipes.vlm.algorithms.responses import ResponseFormat
from mmrecipes.vlm.model.loading import stop_token_ids

ZOOM = {"type": "function", "function": {"name": "zoom", "description": "Zoom in.", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}, "where": {"type": "string"}}}}}
# each family's turns: well-formed, cut inside the reasoning, a call in its own format, two calls, a malformed call,
# and the other families' forms (text to these)
COMPLETIONS = [
    "I think red.\n</think>\n\nred<|im_end|>", "The square is", "red<|im_end|>", "<think>\nA guess.\n</think>\n\nred",
    "<tool_call>\n<function=zoom>\n<parameter=x>\n3\n</parameter>\n<parameter=where>\ntop left\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>",
    "Let me look.\n</think>\n\n<tool_call>\n<function=zoom>\n<parameter=x>\n2\n</parameter>\n</function>\n</tool_call>"
    "\n<tool_call>\n<function=zoom>\n<parameter=where>\n7\n</parameter>\n</function>\n</tool_call><|im_end|>",
    "<tool_call>\n<function=zoom>\n<parameter=x>\n3",
    '<tool_call>\n{"name": "zoom", "arguments": {"x": 3}}\n</tool_call>',
    '<tool_call>\n{"name": "zoom", "arguments": {"x": 3, "where": "top"}}\n</tool_call>\n<tool_call>\n{"name": "zoom", '
    '"arguments": {}}\n</tool_call><|im_end|>', '<tool_call>\n{"name": "zoom", "arguments": {"x": 3</tool_call>',
    "<|channel>thought\nI think red.\n<channel|>red<turn|>", "red<turn|>", "<|channel>thought\nStill thinking",
    '<|tool_call>call:zoom{x:3,where:<|"|>top left<|"|>}<tool_call|><|tool_response>',
    '<|channel>thought\nZoom first.\n<channel|><|tool_call>call:zoom{x:2}<tool_call|><|tool_call>call:zoom{}'
    '<tool_call|><|tool_response>', "<|tool_call>call:zoom{x:"]


# a template that writes a call's arguments as bare words, `<call>name key value key value</call>`: no mark ends a value
BARE_CALLS = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}{%- for part in message.content %}"
    "{{ part.text }}{%- endfor %}{%- for call in message.tool_calls or [] %}{{ '<call>' + call.function.name }}"
    "{%- for key, value in call.function.arguments.items() %}{{ ' ' + key + ' ' + value|string }}{%- endfor %}"
    "{{ '</call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_think", "gemma4", "qwen3_vl"])
def test_turns_read_as_trls_parse_response_reads_them(tiny_vlms, family):
    """Every completion, with and without the tools' schemas (which type the arguments), reads as TRL reads it:
    the reasoning apart where the template writes one (a generation prompt that opened `<think>` included, and a
    turn cut inside it: all reasoning, no answer), the answer, each call of the family's own format with its
    arguments; a malformed call, or another family's form, is text. One difference, by design: Qwen3-VL-Instruct's
    template writes no think block, so a `<think>` its model writes is answer text here, reasoning to TRL's table."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms[family])
    processor = AutoProcessor.from_pretrained(tiny_vlms[family])
    ours = ResponseFormat.of(processor, stop_token_ids(model, processor), calls=True)
    assert ours.source == "found by rendering"
    trl_tokenizer = add_response_schema(AutoProcessor.from_pretrained(tiny_vlms[family])).tokenizer
    assert trl_tokenizer.response_template is not None
    prompt = processor.tokenizer(processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What colour is it?"}]}],
        add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    read = {"reasoning": 0, "calls": 0}
    for completion in COMPLETIONS:
        ids = processor.tokenizer(completion, add_special_tokens=False)["input_ids"]
        for tools in (None, [ZOOM]):
            expected = parse_response(trl_tokenizer, ids, prefix=prompt, tools=tools)
            got = ours.parse(ids, prompt, tools)
            if "reasoning_content" in expected and "reasoning_content" not in ours.template["fields"]:
                # TRL's table gives Qwen3-VL-Instruct Qwen3's think block, which its template never writes: text here
                assert "reasoning_content" not in got and got["content"].endswith(expected["content"]), got
                continue
            assert got == expected, (completion, tools)
        read["reasoning"] += bool(got.get("reasoning_content"))
        read["calls"] += len(got.get("tool_calls", []))
    assert read["calls"] >= 2 and (read["reasoning"] > 0) == (family != "qwen3_vl"), read


def test_the_checkpoints_own_response_template_is_used_and_a_template_it_cannot_read_is_refused(tiny_vlms):
    """A tokenizer that ships a `response_template` is read with it (Gemma 4's checkpoints do); one whose sentinel
    turns do not read back is refused saying what did not; so is a template whose calls its own rendering cannot be
    read back from (arguments as bare words), one whose JSON calls have no marks around them, and one that writes none
    (the tiny Llava's), for tools."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms["gemma4"])
    processor = add_response_schema(AutoProcessor.from_pretrained(tiny_vlms["gemma4"]))
    stops = stop_token_ids(model, processor)
    assert ResponseFormat.of(processor, stops, calls=True).source == "the checkpoint's response_template"
    processor.tokenizer.response_template = {"fields": {"content": {"close_pattern": "$", "content": "text"}}}
    with pytest.raises(ValueError, match=r"cannot be read back \(the checkpoint's response_template\): a turn with "
                                         "reasoning rendered as '<|channel>thought"):
        ResponseFormat.of(processor, stops)
    qwen = AutoProcessor.from_pretrained(tiny_vlms["qwen3_5"])
    qwen.chat_template = BARE_CALLS
    with pytest.raises(ValueError, match=r"cannot be read back \(found by rendering\): a tool call rendered as "
                                         "'<call>tool_name_sentinel first_sentinel value sentinel second_sentinel 7"):
        ResponseFormat.of(qwen, [qwen.tokenizer.convert_tokens_to_ids("<|im_end|>")], calls=True)
    bare = AutoProcessor.from_pretrained(tiny_vlms["qwen3_vl"])  # its JSON calls without their marks
    bare.chat_template = bare.chat_template.replace("<tool_call>", "").replace("</tool_call>", "")
    with pytest.raises(ValueError, match="writes a tool call without marks around it"):
        ResponseFormat.of(bare, [bare.tokenizer.convert_tokens_to_ids("<|im_end|>")], calls=True)
    llava = AutoProcessor.from_pretrained(tiny_vlms["llava"])
    stops = [llava.tokenizer.eos_token_id]
    with pytest.raises(ValueError, match="does not write an assistant turn's tool calls"):
        ResponseFormat.of(llava, stops, calls=True)
    assert "reasoning_content" not in ResponseFormat.of(llava, stops).template["fields"]
