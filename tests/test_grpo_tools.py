"""Multi-turn GRPO with tools (mmrecipes.vlm.algorithms.tools, the sampler's tool turns), in process and on 2 gloo
ranks, on the tiny Qwen3-VL with its official chat template (which writes tool schemas, calls and image results):

- the template decides how calls are read and where a tool's images go (its tool turn, or a user turn after it where
  the template drops them); a template that writes no tool call (Qwen2.5-VL's official one) is refused with why;
- a completion's turns: the model's tokens, then the tools' results as the template writes them (token-in/token-out,
  equal to the whole conversation rendered at once), images through the processor; tool tokens are no target, and
  the forward takes the trajectory (image tokens and features agree);
- tools are user code: each way a call can fail is counted and named, never a crash or a hang;
- 2 ranks whose completions take different numbers of turns sample what one process samples, forwarding together.
"""

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from gloo import run_on_ranks
from helpers import chat_row
from launch import REPO
from mmrecipes.paths import EMBEDDED
from mmrecipes.vlm.algorithms.sampling import Sampler
from mmrecipes.vlm.algorithms.tools import ToolBox, ToolFormat, Tools
from mmrecipes.vlm.algorithms.trajectory import Trajectory, prompt_seed
from mmrecipes.vlm.arguments import GRPOArgs, PromptDataArgs
from mmrecipes.vlm.model.families import dummy_image_inputs, placeholder_token_ids
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.outputs import TokenLogps
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import IGNORE_INDEX, AnswerLabeller
from mmrecipes.vlm.rows.prompts import PromptPreprocessor

sys.path.insert(0, str(REPO / "data_prep"))
import tiny_vlm  # noqa: E402
import tiny_vlm_2026  # noqa: E402

TOOLS = "tools_for_tests:multiply,tools_for_tests:crop"
CALL = '<tool_call>\n{"name": "crop", "arguments": {"left": 3, "top": 4}}\n</tool_call>'
# the crop call as each template writes it, and the end of turn after it
CALLS = {"qwen3_vl": (CALL, "<|im_end|>"), "qwen2_5_vl": (CALL, "<|im_end|>"),
         "embedded": (CALL.replace("\n", ""), "<|end|>"),
         # Qwen3.5's own form: a tag per argument
         "qwen3_5": ("<tool_call>\n<function=crop>\n<parameter=left>\n3\n</parameter>\n<parameter=top>\n4\n"
                     "</parameter>\n</function>\n</tool_call>", "<|im_end|>"),
         # Gemma 4's: call:name{key:value}, the turn ended by <|tool_response>, where the results follow
         "gemma4": ("<|tool_call>call:crop{left:3,top:4}<tool_call|>", "<|tool_response>")}
# Gemma 4's marks, special tokens of its tokenizer (the tiny one's splits them)
GEMMA4_MARKS = ["<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>']


def qwen3_vl(family="qwen3_vl"):
    """A tiny family with a template that writes tool calls: Qwen3-VL's own; Qwen2.5-VL's official one writes none,
    so it gets Qwen3-VL's (the same vision tokens), as `--chat_template_path` would give it; the embedded tiny SFT'd
    Llava, its own (`embedded`)."""
    if family == "embedded":
        model = AutoModelForImageTextToText.from_pretrained(EMBEDDED / "tiny_sft_vlm")
        processor = AutoProcessor.from_pretrained(EMBEDDED / "tiny_sft_vlm")
        return model, processor, stop_token_ids(model, processor)
    if family in tiny_vlm_2026.FAMILIES:  # its own template
        model, processor = tiny_vlm_2026.FAMILIES[family]()
        if family == "gemma4":
            processor.tokenizer.add_special_tokens({"additional_special_tokens": GEMMA4_MARKS})
            model.resize_token_embeddings(len(processor.tokenizer))
        return model, processor, stop_token_ids(model, processor)
    model, processor = tiny_vlm.FAMILIES[family]()
    if family != "qwen3_vl":
        processor.chat_template = tiny_vlm.FAMILIES["qwen3_vl"]()[1].chat_template
    return model, processor, stop_token_ids(model, processor)


def setup(max_completion_length=200, family="qwen3_vl", **flags):
    """(the tiny model as the recipe wraps it, its processor, the sampler with --tools, an image prompt rendered with
    the tools' schemas)."""
    torch.manual_seed(0)
    model, processor, stops = qwen3_vl(family)
    args = GRPOArgs(tools=TOOLS, num_generations=2, max_completion_length=max_completion_length, **flags)
    tools = Tools.of(args, processor, stops)
    preprocess = PromptPreprocessor(PromptDataArgs(), AnswerLabeller(processor, stops), max_length=4096,
                                    tools=tools.schemas())
    row = chat_row("What colour is the shape on the left?", "red", Image.new("RGB", (32, 32), (220, 40, 40)))
    (input_ids, media, prompt, columns, _), _ = preprocess.example(row)
    prompt = {"input_ids": torch.as_tensor(input_ids), "media_inputs": media, "prompt": json.loads(prompt),
              "columns": json.loads(columns)}
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    sampler = Sampler(SimpleNamespace(device=torch.device("cpu")), collator, args, stops,
                      placeholder_token_ids(model, processor), tools)
    return VLMForTraining(model).eval(), processor, sampler, prompt


def calling_turn(processor, sampler, prompt, index=0, call=CALL, end="<|im_end|>"):
    """A trajectory whose first turn is the model calling crop (the tiny model would not on its own), ended by `end`,
    the stop the template writes."""
    trajectory = Trajectory(prompt, index, prompt_seed(0, prompt))
    tokens = processor.tokenizer(call, add_special_tokens=False)["input_ids"] + [
        processor.tokenizer.convert_tokens_to_ids(end)]
    trajectory.add_turn(tokens, False)
    sampler.tools.read(trajectory, tokens)
    return trajectory


def test_the_template_decides_how_calls_are_read_and_where_tool_images_go():
    model, processor, stops = qwen3_vl()
    tools = Tools.of(GRPOArgs(tools=TOOLS), processor, stops)
    calls = tools.format.responses.template["fields"]["tool_calls"]
    assert (calls["open"], calls["close_pattern"], calls["content"], tools.format.images_in_tool_turns) == (
        "<tool_call>", r"</tool_call>\s*", "json", True)
    assert tools.format.describe().startswith("tools: model turns read as the chat template writes them (found by "
                                              "rendering): tool_calls, content;")
    results = [("crop", [{"type": "image", "image": Image.new("RGB", (32, 32))}, {"type": "text", "text": "a region"}])]
    in_tool_turn = processor.tokenizer.decode(tools.format.suffix(results)[0])
    assert in_tool_turn.startswith("\n<|im_start|>user\n<tool_response>\n<|vision_start|>")
    # a template that writes tool calls but drops images in tool turns: the images go in a user turn after it
    image_in_tool = "<|vision_start|><|image_pad|><|vision_end|>"
    template = processor.chat_template
    at = template.index("<tool_response>")
    processor.chat_template = template[:at] + template[at:].replace(image_in_tool, "", 1)
    dropping = ToolFormat.of(processor, stops, tools.schemas())
    assert not dropping.images_in_tool_turns and "a user turn after it" in dropping.describe()
    ids, media = dropping.suffix(results)
    text = processor.tokenizer.decode(ids)
    assert "a region\n</tool_response><|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|>" in text
    assert text.count("<|image_pad|>") == media["image_grid_thw"].prod().item() // 4  # the merger's 2x2 patches
    # Qwen2.5-VL's official template writes no tool call at all: refused, saying so
    _, qwen25 = tiny_vlm.FAMILIES["qwen2_5_vl"]()
    with pytest.raises(ValueError, match="does not write an assistant turn's tool calls"):
        Tools.of(GRPOArgs(tools=TOOLS), qwen25, stops)
    with pytest.raises(ValueError, match="--tools tools_for_tests:nope: cannot import it"):
        Tools.of(GRPOArgs(tools="tools_for_tests:nope"), processor, stops)


def test_a_tool_that_fails_fails_its_call_never_the_run():
    from tools_for_tests import broken, multiply

    box = ToolBox([broken, multiply], timeout=0.5)
    said = {kind: box.run("broken", {"kind": kind})[0]["text"] for kind in ("raise", "exit", "hang", "none", "object",
                                                                          "image")}
    said["unknown"] = box.run("divide", {"a": 1})[0]["text"]
    said["arguments"] = box.run("multiply", {"a": 1, "c": 2})[0]["text"]
    said["unreadable"] = box.run(None, "an unreadable tool call (JSONDecodeError: ...)")[0]["text"]
    assert box.failures == {"broken/raised": 1, "broken/exit": 1, "broken/timeout": 1, "broken/result": 2,
                            "broken/image": 1, "divide/unknown": 1, "multiply/raised": 1, "call/unreadable": 1}
    assert "RuntimeError: the tool broke" in said["raise"] and "sys.exit(3)" in said["exit"]
    assert "ran past --tool_timeout 0.5 s" in said["hang"] and "gave a NoneType" in said["none"]
    assert "no tool divide (the tools: broken, multiply)" in said["unknown"]
    assert box.run("multiply", {"a": 3, "b": 4}) == [{"type": "text", "text": "12"}] and box.calls == 10


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl", "embedded", "qwen3_5", "gemma4"])
def test_a_multi_turn_completion_is_the_models_tokens_then_the_tools_token_in_token_out(family):
    step, processor, sampler, prompt = setup(family=family)
    call, end = CALLS[family]
    trajectory = calling_turn(processor, sampler, prompt, 0, call, end)
    again = calling_turn(processor, sampler, prompt, 0, call, end)
    sampler.tools.tool_turns(sampler.drawing(step, True, prompt), [trajectory])  # generate: the model whole
    sampler.tools.tool_turns(sampler.drawing(step, False, prompt), [again])  # the synced loop (FSDP2, ZeRO-3)
    assert (trajectory.ids, trajectory.own) == (again.ids, again.own)
    first = len(processor.tokenizer(call, add_special_tokens=False)["input_ids"]) + 1
    assert trajectory.own[:first] == [True] * first and trajectory.own[-1] and not all(trajectory.own)
    assert [message["role"] for message in trajectory.messages] == ["assistant", "tool", "assistant"]
    assert trajectory.messages[0]["tool_calls"][0]["function"] == {"name": "crop", "arguments": {"left": 3, "top": 4}}
    # token-in/token-out: the ids are those of the whole conversation rendered at once, up to the second turn
    region = trajectory.messages[1]["content"][0]["image"]
    conversation = [*prompt["prompt"], {"role": "assistant", "content": "",
                                        "tool_calls": trajectory.messages[0]["tool_calls"]},
                    {"role": "tool", "name": "crop", "content": [{"type": "image"}, {"type": "text",
                                                                                     "text": "region at 3,4"}]}]
    text = processor.apply_chat_template(conversation, tools=sampler.tools.schemas(), add_generation_prompt=True)
    whole = processor(text=text, images=[[Image.new("RGB", (32, 32), (220, 40, 40)), region]], return_tensors="pt")
    state = trajectory.state()
    tool_end = len(prompt["input_ids"]) + len(trajectory.own) - trajectory.own[::-1].index(False)
    assert state["input_ids"][:tool_end].tolist() == whole["input_ids"][0].tolist()
    torch.testing.assert_close(state["media_inputs"]["pixel_values"], whole["pixel_values"])
    # the tools' tokens are no target; the forward takes the trajectory (image tokens and features agree)
    row = trajectory.row(True)
    targets = row["labels"][len(prompt["input_ids"]):] != IGNORE_INDEX
    assert targets.tolist() == trajectory.own
    logps = step(sampler.collator([row]), TokenLogps(1.0))
    assert torch.isfinite(logps).all()


def _turns_on_ranks(rank, world):
    """Rank 0's two completions call crop then answer; rank 1's answer at once (or, in one process, all four): each
    completion's tokens, and how many forwards this rank ran."""
    step, processor, sampler, prompt = setup()
    forwards = []
    step.register_forward_hook(lambda *_: forwards.append(1))
    calling = [calling_turn(processor, sampler, prompt, index) for index in (0, 1)]
    answering = [calling_turn(processor, sampler, prompt, index, call="red") for index in (2, 3)]
    mine = calling + answering if world == 1 else [calling, answering][rank]
    sampler.tools.tool_turns(sampler.drawing(step, False, prompt), mine)
    return [trajectory.ids for trajectory in mine], len(forwards)


def test_ranks_whose_completions_take_different_turns_sample_what_one_process_samples():
    (one, _), = [_turns_on_ranks(0, 1)]
    (calls, forwards0), (answers, forwards1) = run_on_ranks(_turns_on_ranks, 2)
    assert calls + answers == one
    assert forwards0 == forwards1 > 0  # the rank without a tool call forwarded a filler as often


def test_an_environment_per_completion_keeps_its_state_over_turns():
    """--environment_factory (TRL's): one instance per completion, reset with its row; its public methods are the
    tools, rendered in the prompt; the counter of one completion is its own."""
    torch.manual_seed(0)
    model, processor, stops = qwen3_vl()
    args = GRPOArgs(environment_factory="tools_for_tests:CounterEnv", max_completion_length=400)
    tools = Tools.of(args, processor, stops)
    assert [tool["function"]["name"] for tool in tools.schemas()] == ["increment"]
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    sampler = Sampler(SimpleNamespace(device=torch.device("cpu")), collator, args, stops,
                      placeholder_token_ids(model, processor), tools)
    preprocess = PromptPreprocessor(PromptDataArgs(), AnswerLabeller(processor, stops), max_length=4096,
                                    tools=tools.schemas())
    (input_ids, media, prompt, columns, _), _ = preprocess.example(chat_row("Count to four.", "4"))
    prompt = {"input_ids": torch.as_tensor(input_ids), "media_inputs": media, "prompt": json.loads(prompt),
              "columns": json.loads(columns)}
    increments = '<tool_call>\n{"name": "increment", "arguments": {"step": 2}}\n</tool_call>'
    trajectories = []
    for index, call in enumerate([increments + increments, increments]):
        trajectory = calling_turn(processor, sampler, prompt, index, call)
        trajectory.environment, _ = tools.environment(prompt)
        trajectories.append(trajectory)
    sampler.tools.tool_turns(sampler.drawing(VLMForTraining(model).eval(), True, prompt), trajectories)
    results = [[message["content"][0]["text"] for message in trajectory.messages if message["role"] == "tool"]
               for trajectory in trajectories]
    assert results == [["2", "4"], ["2"]]
    assert tools.take_counts() == {"tool_calls": 3, "tool_failures": 0}


def test_the_recipe_renders_and_runs_tools_and_refuses_a_template_without_them(tmp_path, capsys):
    """vlm_grpo.py --tools: the prompts carry the tools' schemas, the log says how calls are read and how often the
    model called (TRL's tools/call_frequency); Llava-1.5's official template writes no tool call: refused before the
    first step."""
    from launch import load_recipe

    model, processor, _ = qwen3_vl()
    model.save_pretrained(tmp_path / "qwen3_vl")
    processor.save_pretrained(tmp_path / "qwen3_vl")
    recipe = load_recipe(REPO / "recipes" / "vlm_grpo.py")
    recipe.main(["--model_name_or_path", str(tmp_path / "qwen3_vl"), "--tools", TOOLS, "--max_steps", "1",
                 "--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "8",
                 "--max_length", "2048", "--eval_steps", "9", "--report_to", "none", "--output_dir",
                 str(tmp_path / "run")])
    log = capsys.readouterr().out
    assert ("tools: model turns read as the chat template writes them (found by rendering): tool_calls, content; a "
            "tool's images go in the tool turn") in log
    assert "tools/call_frequency 0.0 | tools/failure_frequency 0.0" in log
    with pytest.raises(ValueError, match="does not write an assistant turn's tool calls"):
        recipe.main(["--tools", TOOLS, "--chat_template_path", str(REPO / "data_prep" / "chat_templates" /
                                                                     "llava.jinja"),
                     "--report_to", "none", "--output_dir", str(tmp_path / "llava")])


def test_what_reset_returns_joins_the_prompt_and_get_reward_scores_the_completion():
    """TRL's environment API: a string reset returns is appended to the row's last user turn, the prompt rendered
    anew with its image (kept as PNG by the preprocessor) and the tools' schemas; get_reward, the environment's
    reward for the completion (one that raises fails that completion only). Each completion samples from its own
    prompt: `generate` and the synced loop alike."""
    torch.manual_seed(0)
    model, processor, stops = qwen3_vl()
    args = GRPOArgs(environment_factory="tools_for_tests:ObservedCounterEnv", reward_funcs="",
                    max_completion_length=16, num_generations=2, temperature=2.0)
    tools = Tools.of(args, processor, stops)
    assert tools.reward_name == "ObservedCounterEnv" and Tools.prompt_settings(tools)["keep_images"]
    preprocess = PromptPreprocessor(PromptDataArgs(), AnswerLabeller(processor, stops), max_length=4096,
                                    **Tools.prompt_settings(tools))
    red = Image.new("RGB", (32, 32), (220, 40, 40))
    (input_ids, media, prompt, columns, images), _ = preprocess.example(chat_row("Count.", "4", red))
    prompt = {"input_ids": torch.as_tensor(input_ids), "media_inputs": media, "prompt": json.loads(prompt),
              "columns": json.loads(columns), "images": images}
    environment, own = tools.environment(prompt)
    text = processor.apply_chat_template([*prompt["prompt"][:-1], {"role": "user", "content": [
        *prompt["prompt"][-1]["content"], {"type": "text", "text": "The counter starts at zero."}]}],
        tools=tools.schemas(), add_generation_prompt=True)
    expected = processor(text=text, images=[red])
    assert own["input_ids"].tolist() == list(expected["input_ids"][0]) and own["input_ids"].tolist() != input_ids
    torch.testing.assert_close(own["media_inputs"]["pixel_values"], prompt["media_inputs"]["pixel_values"])
    environment.counter = 3
    failing = tools.factories[None]()
    failing.counter = 101
    rewards = tools.reward(None, None, environments=[environment, None, failing])
    assert rewards[0] == 3.0 and [reward.why for reward in rewards[1:]] == [
        "its environment's reset failed (said with the tools' failures)",
        "the environment's get_reward raised RuntimeError: counted too far"], rewards
    layout = SimpleNamespace(pieces=lambda: [(0, [0, 1])])
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    sampler = Sampler(SimpleNamespace(device=torch.device("cpu")), collator, args, stops,
                      placeholder_token_ids(model, processor), tools)
    step = VLMForTraining(model).eval()
    by_generate, by_loop = (sampler.tools.environment_turns(sampler.drawing(step, whole, prompt), [prompt], layout, 0)
                            for whole in (True, False))
    assert [t.ids for t in by_generate] == [t.ids for t in by_loop] and by_generate[0].ids != by_generate[1].ids
    assert all(t.prompt["input_ids"].tolist() == own["input_ids"].tolist() for t in by_generate)


def test_rows_pick_their_environment_among_several():
    """--environment_factory name=module:Class,...: TRL's dict of environments; a row's `environment` column picks its
    class, its prompt renders that class's tools, reset gets the row without the column; the environments' reward is
    get_reward where the class has one, 0 where it has none; a row naming no given class is a counted bad row."""
    from mmrecipes.skips import Skip
    from mmrecipes.sources import OTHER_COLUMNS

    model, processor, stops = qwen3_vl()
    args = GRPOArgs(environment_factory="counter=tools_for_tests:CounterEnv,observed=tools_for_tests:"
                                        "ObservedCounterEnv", tools="tools_for_tests:multiply")
    tools = Tools.of(args, processor, stops)
    assert tools.reward_name == "environment" and set(Tools.prompt_settings(tools)["tools"]) == {"counter", "observed"}
    preprocess = PromptPreprocessor(PromptDataArgs(), AnswerLabeller(processor, stops), max_length=4096,
                                    **Tools.prompt_settings(tools))
    prompts, environments = [], []
    for name in ("counter", "observed"):
        row = {"prompt": [{"role": "user", "content": "Count."}], "solution": "4",
               OTHER_COLUMNS: json.dumps({"environment": name})}
        (input_ids, media, prompt, columns, images), _ = preprocess.example(row)
        prompt = {"input_ids": torch.as_tensor(input_ids), "media_inputs": media, "prompt": json.loads(prompt),
                  "columns": json.loads(columns), "images": images}
        assert "multiply" in processor.tokenizer.decode(input_ids)  # the standalone tool beside the class's
        environment, own = tools.environment(prompt)
        prompts.append((prompt, own))
        environments.append(environment)
    assert [type(environment).__name__ for environment in environments] == ["CounterEnv", "ObservedCounterEnv"]
    assert prompts[0][1] is prompts[0][0] and "starts at zero" in processor.tokenizer.decode(prompts[1][1]["input_ids"])
    environments[1].counter = 2
    assert tools.reward(None, None, environments=environments) == [0.0, 2.0]
    with pytest.raises(Skip, match="environment 'chess': not one of --environment_factory's"):
        preprocess.example({"prompt": "Play.", OTHER_COLUMNS: json.dumps({"environment": "chess"})})


@pytest.mark.parametrize("limit", [1, 2])
def test_max_tool_calling_iterations_and_tool_timeout_as_flags(limit, monkeypatch):
    """`--max_tool_calling_iterations N`: at most N rounds of tool results, however often the model calls (here a
    model turn that always calls crop: the tiny model would not); `--tool_timeout`: a call's limit, as TRL's docs
    have no such flag."""
    from launch import load_recipe
    from mmrecipes.config import parse_args
    from mmrecipes.vlm.algorithms import sampling

    parsed = parse_args(load_recipe(REPO / "recipes" / "vlm_grpo.py").ARGUMENTS, [
        "--tools", TOOLS, "--max_tool_calling_iterations", str(limit), "--tool_timeout", "7.5",
        "--max_completion_length", "400", "--max_length", "4096"])
    grpo_args = next(args for args in parsed if isinstance(args, GRPOArgs))
    step, processor, sampler, prompt = setup(max_completion_length=400)
    model, processor, stops = qwen3_vl()
    tools = Tools.of(grpo_args, processor, stops)
    assert (tools.max_iterations, tools.box.timeout) == (limit, 7.5)
    sampler.tools, sampler.args = tools, grpo_args
    calling = processor.tokenizer(CALL, add_special_tokens=False)["input_ids"] + [
        processor.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    monkeypatch.setattr(sampling, "generate_group", lambda *args, **kwargs: [(list(calling), False)])
    trajectory = calling_turn(processor, sampler, prompt)
    sampler.tools.tool_turns(sampler.drawing(step, True, prompt), [trajectory])
    assert [message["role"] for message in trajectory.messages] == ["assistant", "tool"] * limit + ["assistant"]
    assert tools.take_counts() == {"tool_calls": limit, "tool_failures": 0}
    assert trajectory.messages[-1]["tool_calls"]  # its last call is never run
