"""Tools and environments for multi-turn GRPO, TRL 1.16's API: `--tools module:function,...`,
`--environment_factory module:Class`, `--max_tool_calling_iterations`, `--tool_timeout`
(docs/grpo.md, "Tools").

A completion that calls tools (in the template's own tool-call format, found by rendering one:
`ToolFormat`) has each call run (`ToolBox.run`), the results rendered as the template renders tool
turns and appended after the model's tokens as token ids (`ToolFormat.suffix`: never re-tokenised),
and the model goes on from there, until it calls no tool, --max_tool_calling_iterations, or
--max_completion_length (tool tokens count). A tool's images go through the processor, their inputs
after the prompt's; where the template drops images in a tool turn, they go in a user turn after it
(said at start-up). Tool-result tokens are no target: the loss, the KL and the entropy read the
model's only.

Tools are user code (`user_code`: imported by path, timed, the same guards as rewards): a call that
raises (`sys.exit` and other BaseExceptions such as `asyncio.CancelledError` included; a real Ctrl-C
still ends the run), runs past --tool_timeout, names no known tool, gives something that is neither
text (a string or a number) nor content blocks, text holding the model's image placeholder, or an
image that does not decode (as training images decode: `images.decode_image`; an empty one included)
fails that call: counted per kind, its error the result the model reads (TRL's `{"error": ...}`),
never a crashed or hung run. `async def` tools are awaited within the same time limit. An
environment's construction and reset run within --tool_timeout too; one that fails, or whose
observation would not fit the prompt's length, leaves its completion with the standalone tools
(counted). Each kind of failure is said once with its reason and the ranks it happened on.
"""

import inspect
from collections import Counter

import torch
from accelerate.utils import gather_object
from PIL import Image
from transformers.utils import get_json_schema

from ...images import decode_image, readable_source
from ..rows.chat_data import MAX_CHARS_PER_TOKEN, TOKEN_ALIGNED, prompt_row, unbatched
from .responses import ResponseFormat, calling
from .trajectory import Trajectory, first_turns, prompt_seed
from .user_code import EnvironmentTimeout, ToolTimeout, Unscored, awaited, imported, time_limit

# a turn's generator: its completion's index + turn x this (the first turn's is the index)
TURN_STRIDE = 1 << 20

SENTINEL = {"name": "tool_name_sentinel", "arguments": {"argument_sentinel": "value_sentinel"}}


def load_tools(spec: str, seconds: float | None = None) -> list:
    """The functions of `--tools` (comma-separated module:function, each module's import within
    `seconds`); `Tools.of` describes each (`schema`). Two of one name would shadow each other:
    refused."""
    tools = [imported(path.strip(), "--tools", seconds) for path in spec.split(",") if path.strip()]
    names = [getattr(tool, "__name__", repr(tool)) for tool in tools]
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"--tools {spec}: more than one tool named {', '.join(repeated)}; the model calls tools by "
                         "name, so one would never run")
    return tools


def schema(tool, flag: str) -> dict:
    """The JSON schema transformers renders from a tool's type hints and docstring; one it cannot
    stops the run before step 1."""
    try:
        return get_json_schema(tool)
    except Exception as error:  # noqa: BLE001 (transformers' own errors name what is missing)
        raise ValueError(f"{flag}: {getattr(tool, '__name__', tool)} cannot be described to the model ({error})")


def environment_factories(spec: str, seconds: float | None = None) -> dict:
    """`--environment_factory`: module:Class ({None: the class}), or name=module:Class,... (TRL's
    dict: a row's `environment` column picks its class); a class, or any callable that returns an
    environment."""
    if not spec:
        return {}
    if "=" not in spec:
        return {None: imported(spec, "--environment_factory", seconds)}
    factories = {}
    for entry in spec.split(","):
        name, _, path = entry.strip().partition("=")
        if not name or not path:
            raise ValueError(f"--environment_factory {entry!r}: give module:Class, or name=module:Class,...")
        if name in factories:
            raise ValueError(f"--environment_factory: {name} named twice; each name picks one class")
        factories[name] = imported(path, "--environment_factory", seconds)
    return factories


def environment_probes(factories: dict, spec: str, seconds: float) -> dict:
    """An instance of each environment class (its methods read as TRL reads them), each built within
    `seconds`; one that cannot be built, or has no reset, stops the run before step 1."""
    probes = {}
    for name, factory in factories.items():
        try:
            with time_limit(seconds, f"--environment_factory {spec}: building an environment", "--tool_timeout",
                            EnvironmentTimeout):
                probes[name] = factory()
        except (Exception, EnvironmentTimeout) as error:  # noqa: BLE001 (user code: named before step 1)
            raise ValueError(f"--environment_factory {spec}: building an environment failed ({type(error).__name__}: "
                             f"{error}); give a class, or a callable that returns an environment") from None
    if missing := [name for name, probe in probes.items() if not callable(getattr(probe, "reset", None))]:
        raise ValueError(f"--environment_factory: instances of {', '.join(map(str, missing))} have no reset method")
    return probes


def offered_tools(tools: list, probes: dict) -> dict:
    """{environment name: the tools a prompt offers} (the standalone tools, and its environment's
    methods); a method named as a standalone tool is refused (the model calls by name: one would
    never run), and so is offering none."""
    names = {tool.__name__ for tool in tools}
    for probe in probes.values():
        if shadowed := sorted(names & {tool.__name__ for tool in environment_tools(probe)}):
            raise ValueError(f"--tools and --environment_factory: {type(probe).__name__} has a method named "
                             f"{', '.join(shadowed)}, as a tool is: the model calls tools by name, so one would never "
                             "run")
    offered = {name: tools + environment_tools(probe) for name, probe in probes.items()} or {None: tools}
    if not all(offered.values()):
        raise ValueError("--tools / --environment_factory: no tool to call (an environment's tools are its public "
                         "methods besides reset and get_reward)")
    return offered


def environment_tools(environment) -> list:
    """An environment's tools: its public methods but reset and get_reward (TRL's rule)."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class ToolFormat:
    """How the chat template writes a model's turn and its tool calls (`responses.ResponseFormat`),
    tool schemas and tool turns, found by rendering them (with `template_kwargs`:
    --chat_template_kwargs); `of` refuses a template that writes none of them, or calls it cannot
    read back."""

    def __init__(self, processor, stop_ids, responses: ResponseFormat, images_in_tool_turns: bool,
                 template_kwargs=None):
        self.processor, self.responses = processor, responses
        self.template_kwargs = template_kwargs or {}
        self.images_in_tool_turns = images_in_tool_turns
        # a calling turn's own end where the template ends it otherwise than an answer (Gemma 4's `<|tool_response>`,
        # one token of its tokenizer): sampling stops there too, and the results follow it
        ends = processor.tokenizer(responses.after_calls, add_special_tokens=False)["input_ids"]
        self.extra_stops = ends if responses.after_calls and len(ends) == 1 else []
        self.stop_ids = set(stop_ids) | set(self.extra_stops)

    @classmethod
    def of(cls, processor, stop_ids, schemas: list, template_kwargs=None) -> "ToolFormat":
        def render(messages, **kwargs):
            return processor.apply_chat_template(messages, **kwargs, **(template_kwargs or {}))

        where = "the model's chat template (--chat_template_path gives another)"
        try:
            responses = ResponseFormat.of(processor, stop_ids, template_kwargs, calls=True)
        except ValueError as error:
            raise ValueError(f"--tools: {where}: {error}") from None
        user = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
        if schemas[0]["function"]["name"] not in render([user], tools=schemas):
            raise ValueError(f"--tools: {where} does not write the tools' schemas: the model would not know them")
        result = {"role": "tool", "name": SENTINEL["name"],
                  "content": [{"type": "image"}, {"type": "text", "text": "result_sentinel"}]}
        turn = render([user, calling(SENTINEL["name"], {}), result], add_generation_prompt=True)
        if "result_sentinel" not in turn:
            raise ValueError(f"--tools: {where} does not write tool turns: the model would never see a result")
        after = turn[turn.rindex("result_sentinel") + len("result_sentinel"):]
        if responses.template.get("start_anchor", "") not in after:  # the model goes on after the results
            after = after.strip()
            responses.after_results(after[after.rfind("<"):] if "<" in after else after)
        image_token = getattr(processor, "image_token", None)
        called = render([user, calling(SENTINEL["name"], SENTINEL["arguments"])])
        images = bool(image_token) and turn.count(image_token) > called.count(image_token)
        return cls(processor, stop_ids, responses, images, template_kwargs)

    def describe(self) -> str:
        where = ("in the tool turn" if self.images_in_tool_turns else
                 "in a user turn after it (the chat template drops images in tool turns)")
        return f"tools: {self.responses.describe()}; a tool's images go {where}"

    def parse(self, ids: list, prefix_ids: list, tools=None) -> tuple[dict, list]:
        """(the model's turn `ids` after `prefix_ids` as a message, [(name, arguments) or (None, why
        it is unreadable)]): a turn the template cannot read whole (a malformed call) is text, its
        calls one unreadable call where it opened one."""
        message, problem = self.responses.read(ids, prefix_ids, tools)
        calls = [(call["function"]["name"], call["function"].get("arguments") or {})
                 for call in message.get("tool_calls") or []]
        if problem and self.responses.calls_opened(message["content"]):
            calls = [(None, f"an unreadable tool call ({problem[:200]})")]
        return message, calls

    def suffix(self, results: list) -> tuple[torch.Tensor, dict]:
        """The token ids (and the images' inputs) of tool results `[(name, content blocks)]` as the
        template writes them after an assistant turn, up to the next generation prompt: the
        difference between a conversation rendered with them and without, cut after the model's stop
        token, as TRL 1.16 cuts it."""
        user = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
        before = [user, calling(results[0][0], {})]
        turns, images = [], []
        for name, blocks in results:
            images += [block["image"] for block in blocks if block["type"] == "image"]
            kept = blocks if self.images_in_tool_turns else [block for block in blocks if block["type"] == "text"]
            turns.append({"role": "tool", "name": name,
                          "content": [{"type": block["type"], **({"text": block["text"]} if "text" in block else {})}
                                      for block in kept]})
        if images and not self.images_in_tool_turns:
            turns.append({"role": "user", "content": [{"type": "image"}] * len(images)})
        prefix = self.processor(text=self.processor.apply_chat_template(before, **self.template_kwargs))["input_ids"][0]
        text = self.processor.apply_chat_template(before + turns, add_generation_prompt=True, **self.template_kwargs)
        ids, media = unbatched(self.processor(text=text, images=[images] if images else None))
        ends = [index for index, token in enumerate(prefix) if token in self.stop_ids]
        cut = ends[-1] + 1 if ends else len(prefix)
        if ids[:cut].tolist() != list(prefix[:cut]):
            raise ValueError("--tools: the chat template writes an assistant turn otherwise once a tool turn follows; "
                             "tool results cannot be appended to the model's tokens")
        return ids[cut:], {key: value[cut:] if key in TOKEN_ALIGNED else value for key, value in media.items()}


class ToolBox:
    """Runs calls of the tools (`--tools`, and a completion's environment's methods), each within
    `timeout` seconds, and counts the failures by kind (`failures`: {"<tool>/<kind>": calls}) and
    the calls."""

    def __init__(self, tools: list, timeout: float, placeholders: tuple = ()):
        self.tools, self.timeout = {tool.__name__: tool for tool in tools}, timeout
        # the processor's media placeholders: text holding one fails its call
        self.placeholders = placeholders
        self.calls, self.failures, self.first_errors = 0, Counter(), {}

    def run(self, name, arguments, environment=None) -> list:
        """The content blocks of one call's result (its error as text where it failed)."""
        self.calls += 1
        tools = self.tools | ({tool.__name__: tool for tool in environment_tools(environment)} if environment else {})
        if name is None:
            return self._failed("unreadable", "call", arguments)
        if name not in tools:
            return self._failed("unknown", name, f"no tool {name} (the tools: {', '.join(sorted(tools))})")
        if not isinstance(arguments, dict):
            return self._failed("arguments", name, f"arguments {arguments!r:.60} are not an object")
        try:
            with time_limit(self.timeout, f"tool {name}", "--tool_timeout", ToolTimeout):
                return blocks(awaited(tools[name](**arguments)), self.placeholders)
        except ToolTimeout as error:
            return self._failed("timeout", name, str(error))
        except SystemExit as error:
            return self._failed("exit", name, f"it called sys.exit({error.code!r}), which would end the run")
        except BadResult as error:
            return self._failed(error.kind, name, str(error))
        except KeyboardInterrupt:  # Ctrl-C ends the run, as it does anywhere else
            raise
        except BaseException as error:  # noqa: BLE001 (user code's errors, asyncio.CancelledError too: the call)
            return self._failed("raised", name, f"{type(error).__name__}: {str(error)[:500]}")

    def _failed(self, kind: str, name: str, why: str) -> list:
        self.failures[f"{name}/{kind}"] += 1
        self.first_errors.setdefault(f"{name}/{kind}", why)
        return [{"type": "text", "text": str({"error": why})}]


class PromptTooLong(Exception):
    """An environment's observation would make its prompt longer than a prompt may be."""


class BadResult(Exception):
    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind = kind


def blocks(result, placeholders: tuple = ()) -> list:
    """A tool's result as content blocks: text (a string or a number, as TRL writes it) or blocks of
    text and images (each image decoded now, as a training image: one that does not decode fails the
    call). Text holding one of the processor's media `placeholders` fails it too: the processor
    would count an image that is not there."""
    if isinstance(result, (str, int, float, bool)):
        result = [{"type": "text", "text": str(result)}]
    if not isinstance(result, list) or not all(isinstance(block, dict) and block.get("type") in ("text", "image")
                                               for block in result):
        raise BadResult("result", f"gave a {type(result).__name__}, neither text nor content blocks: {result!r:.60}")
    loaded = []
    for block in result:
        if block["type"] == "text":
            text = str(block.get("text", ""))
            if found := [placeholder for placeholder in placeholders if placeholder in text]:
                raise BadResult("placeholder", f"gave text holding the model's placeholder {found[0]!r}, which "
                                               "stands for an image the result does not hold")
            loaded.append({"type": "text", "text": text})
            continue
        image, problem = decode_image(block.get("image"), Image.MAX_IMAGE_PIXELS)
        if image is None:
            raise BadResult("image", f"gave an image that does not decode ({problem}: {block.get('image')!r:.60})")
        loaded.append({"type": "image", "image": image})
    return loaded


def characters(results: list) -> int:
    """The characters of text in tool results `[(name, content blocks)]`: a bound on their tokens,
    read before any is tokenised (`MAX_CHARS_PER_TOKEN`)."""
    return sum(len(block.get("text", "")) for _, content in results for block in content)


class Tools:
    """What multi-turn rollouts take (`of`: None without --tools and --environment_factory): the
    template's format, the tools and their runner, the environment classes ({name: class}, None the
    name of a single one; a row's `environment` column names its class where there are several),
    --max_tool_calling_iterations, the tokenizer."""

    def __init__(self, tool_format: ToolFormat, box: ToolBox, factories: dict, schemas: dict,
                 max_iterations: int | None, tokenizer, reward_name: str | None = None,
                 max_prompt_length: int | None = None, max_completion_length: int | None = None):
        self.format, self.box, self.factories, self._schemas = tool_format, box, factories, schemas
        self.max_iterations, self.tokenizer = max_iterations, tokenizer
        self.max_completion_length = max_completion_length
        # where environments score completions (`get_reward`): the reward's name
        self.reward_name = reward_name
        # a prompt with its environment's observation: at most this
        self.max_prompt_length = max_prompt_length
        self.environment_failures, self.said = Counter(), set()

    @classmethod
    def of(cls, args, processor, stop_ids, max_length: int | None = None, template_kwargs=None) -> "Tools | None":
        """The run's tools (`args`: GRPOArgs), None without; `max_length`: --max_length, of which a
        prompt may take what --max_completion_length leaves; `template_kwargs`:
        --chat_template_kwargs."""
        if not args.tools and not args.environment_factory:
            return None
        tools = load_tools(args.tools, args.tool_timeout)
        factories = environment_factories(args.environment_factory, args.tool_timeout)
        probes = environment_probes(factories, args.environment_factory, args.tool_timeout)
        offered = offered_tools(tools, probes)
        schemas = {name: [schema(tool, "--tools") for tool in offered[name]] for name in offered}
        every = {tool["function"]["name"]: tool for offered_schemas in schemas.values() for tool in offered_schemas}
        tool_format = ToolFormat.of(processor, stop_ids, list(every.values()), template_kwargs)
        owners = [type(probe).__name__ for probe in probes.values() if callable(getattr(probe, "get_reward", None))]
        if not args.funcs and not owners:
            raise ValueError("--reward_funcs is empty and no environment has get_reward: nothing scores the "
                             "completions")
        reward_name = (owners[0] if len(probes) == 1 else "environment") if owners else None
        placeholders = tuple(token for token in (getattr(processor, "image_token", None),
                                                 getattr(processor, "video_token", None)) if token)
        prompt_length = max_length - args.max_completion_length if max_length else None
        return cls(tool_format, ToolBox(tools, args.tool_timeout, placeholders), factories, schemas,
                   args.max_tool_calling_iterations, processor.tokenizer, reward_name, prompt_length,
                   args.max_completion_length)

    @staticmethod
    def reward_sources(tools: "Tools | None", funcs: dict, weights: list) -> tuple[dict, list]:
        """The reward functions and their weights, with the environments' `reward` where they score
        completions (their class's name, weight 1: TRL's way)."""
        if tools is None or tools.reward_name is None:
            return funcs, weights
        return funcs | {tools.reward_name: tools.reward}, [*weights, 1.0]

    @staticmethod
    def prompt_settings(tools: "Tools | None") -> dict:
        """`PromptPreprocessor`'s: the tools' schemas every prompt renders ({environment: schemas}
        where rows name theirs), and the images kept where environments may render a prompt anew."""
        if tools is None:
            return {}
        several = len(tools.factories) > 1
        return {"tools": tools._schemas if several else tools.schemas(), "keep_images": bool(tools.factories)}

    def schemas(self, environment: str | None = None) -> list[dict]:
        """The JSON schemas a prompt renders: the standalone tools', and its environment's
        methods'."""
        return next(iter(self._schemas.values())) if len(self._schemas) == 1 else self._schemas[environment]

    def describe(self) -> str:
        limit = self.max_iterations if self.max_iterations is not None else "no limit but --max_completion_length"
        names = ", ".join(sorted({tool["function"]["name"] for schemas in self._schemas.values() for tool in schemas}))
        return f"{self.format.describe()}; the tools: {names}; tool turns: {limit}"

    def rollout(self, draw, prompts, layout, seed: int, accelerator=None) -> tuple[list, dict]:
        """(a `Trajectory` per completion of this rank's pieces, what `sampling.Rollouts` holds of
        multi-turn completions): each first turn from its prompt (with environments, its own:
        `environment_turns`), then the tools' turns (`tool_turns`); `draw`: the sampler's bound call
        (`Sampler.drawing`). The calls' counts are taken (a collective: every rank rolls out at the
        same step)."""
        if self.factories:
            trajectories = self.environment_turns(draw, prompts, layout, seed)
        else:
            trajectories = first_turns(draw, prompts, layout, seed)
        for trajectory in trajectories:
            self.read(trajectory, trajectory.ids)
        self.tool_turns(draw, trajectories)
        return trajectories, {"conversations": [trajectory.messages for trajectory in trajectories],
                              "environments": [trajectory.environment for trajectory in trajectories],
                              "tool_counts": self.take_counts(accelerator)}

    def environment_turns(self, draw, prompts, layout, seed: int) -> list:
        """With environments: each completion's own environment, reset with its row, and its first
        turn sampled from its own prompt (the row's, with what reset returned), from its group's
        seed and its index."""
        trajectories = []
        for index, indices in layout.pieces():
            prompt = prompts[index]
            group_seed = prompt_seed(seed, prompt)
            for completion in indices:
                environment, own = self.environment(prompt)
                trajectories.append(Trajectory(own, completion, group_seed, environment=environment))
        groups = draw([(trajectory.prompt, trajectory.seed, [trajectory.index], None) for trajectory in trajectories])
        for trajectory, group in zip(trajectories, groups):
            trajectory.add_turn(*group[0])
        return trajectories

    def tool_turns(self, draw, trajectories: list):
        """Each trajectory's tool calls run and their results appended, then its next turn sampled
        (its own generator for each turn), until none calls a tool on any rank, or
        --max_tool_calling_iterations. Results that cannot fit the completion's room end it as it is
        (TRL's way), found too long before tokenising where their text alone is
        (`MAX_CHARS_PER_TOKEN`)."""
        budget, turn = self.max_completion_length, 0  # a completion's tokens, the tools' included
        while self.max_iterations is None or turn < self.max_iterations:
            turn += 1
            going = []
            for trajectory in [trajectory for trajectory in trajectories if trajectory.pending]:
                results = [(name or "call", self.box.run(name, arguments, trajectory.environment))
                           for name, arguments in trajectory.pending]
                room = budget - len(trajectory.ids)
                # cannot fit: never tokenised (10 MB: 155 s)
                if characters(results) > MAX_CHARS_PER_TOKEN * room:
                    trajectory.pending = []
                    continue
                ids, media = self.format.suffix(results)
                if len(ids) >= room:  # no room for the results and an answer: it ends as it is
                    trajectory.pending = []
                    continue
                trajectory.add_results(results, ids, media)
                going.append(trajectory)
            if draw.on_every_rank(not going):  # no completion goes on, on any rank
                break
            groups = draw([(trajectory.state(), trajectory.seed, [trajectory.index + turn * TURN_STRIDE],
                            budget - len(trajectory.ids)) for trajectory in going])
            for trajectory, group in zip(going, groups):
                tokens, truncated = group[0]
                trajectory.add_turn(tokens, truncated)
                self.read(trajectory, tokens)

    def read(self, trajectory: Trajectory, tokens: list):
        """A turn the model wrote, read as the template writes it (`ToolFormat.parse`: TRL's message,
        its reasoning, answer and calls, the calls typed by the tools' schemas) and the calls to run
        next (none where it was truncated)."""
        before = trajectory.ids[:len(trajectory.ids) - len(tokens)]
        message, calls = self.format.parse(tokens, trajectory.prompt["input_ids"].tolist() + before,
                                           self.schemas(trajectory.prompt["columns"].get("environment")))
        trajectory.pending = [] if trajectory.truncated else calls
        trajectory.messages.append(message)

    def environment(self, prompt: dict) -> tuple[object, dict]:
        """(a fresh environment for one completion, reset with its row; the prompt it goes on from:
        the row's, with what reset returned appended to its last user turn, TRL's way). Where reset
        fails, (None, the row's prompt): counted, and the completion has the standalone tools
        only."""
        columns = dict(prompt["columns"])
        # TRL keeps the column from reset; a dict of one entry picks that one
        name = columns.pop("environment", None) if len(self.factories) > 1 else next(iter(self.factories))
        try:
            with time_limit(self.box.timeout, "an environment's construction and reset", "--tool_timeout",
                            EnvironmentTimeout):
                environment = self.factories[name]()
                observation = environment.reset(prompt=prompt["prompt"], **columns)
                if observation is not None:
                    observed = self.observed(prompt, observation, name)
            return environment, observed if observation is not None else prompt
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # noqa: BLE001 (user code: the rollout goes on without it)
            kind = f"reset/{type(error).__name__}"
            self.environment_failures[kind] += 1
            self.box.first_errors.setdefault(kind, f"the environment's reset: {type(error).__name__}: "
                                                   f"{str(error)[:500]}")
            return None, prompt

    def observed(self, prompt: dict, observation, environment: str | None = None) -> dict:
        """The prompt with `observation` (text or content blocks) appended to its last turn,
        rendered anew with the row's images and the observation's (a conversational prompt only, as
        TRL requires)."""
        if not isinstance(prompt["prompt"], list):
            raise TypeError("reset() returned an observation for a string prompt: give conversational prompts")
        added = blocks(observation, self.box.placeholders)
        length, text = self.max_prompt_length, characters([(None, added)])
        if length and text > MAX_CHARS_PER_TOKEN * length:  # found before tokenising it
            raise PromptTooLong(f"its observation's {text:,} characters cannot fit a prompt of {length} tokens "
                                "(--max_length less --max_completion_length)")
        last = prompt["prompt"][-1]
        content = [{"type": "text", "text": last["content"]}] if isinstance(last["content"], str) else last["content"]
        content = content + [{"type": block["type"], **({"text": block["text"]} if "text" in block else {})}
                             for block in added]
        messages = [*prompt["prompt"][:-1], {**last, "content": content}]
        images = [Image.open(readable_source(data)) for data in prompt["images"]]
        images += [block["image"] for block in added if block["type"] == "image"]
        rendered = prompt_row(self.format.processor, messages, images, self.schemas(environment),
                              self.format.template_kwargs)
        if length and len(rendered["input_ids"]) > length:
            raise PromptTooLong(f"the prompt with its observation is {len(rendered['input_ids'])} tokens, over "
                                f"{length} (--max_length less --max_completion_length)")
        return prompt | {"input_ids": rendered["input_ids"], "media_inputs": rendered["media_inputs"],
                         "prompt": messages}

    def reward(self, prompts, completions, completion_ids=None, environments=(), **columns) -> list:
        """The environments' `get_reward()`, one per completion: 0 where its class has none (among
        several, one that owns no reward); where reset or get_reward failed, `Unscored` with the
        reason (that completion's reward fails, counted and said with the user's error)."""
        rewards = []
        for environment in environments:
            if environment is None:
                rewards.append(Unscored("its environment's reset failed (said with the tools' failures)"))
                continue
            try:
                owns = callable(getattr(environment, "get_reward", None))
                rewards.append(awaited(environment.get_reward()) if owns else 0.0)
            except Exception as error:  # noqa: BLE001 (user code: one completion's reward fails, counted)
                rewards.append(Unscored(f"the environment's get_reward raised {type(error).__name__}: {error}"))
        return rewards

    def take_counts(self, accelerator=None, say=print) -> dict:
        """Calls and failed calls on this rank since the last call, for the log; each kind of
        failure said once, by name, with the ranks it happened on (gathered: every rank calls this
        at the same step)."""
        failures = self.box.failures + self.environment_failures
        counts = {"tool_calls": self.box.calls, "tool_failures": sum(failures.values())}
        rank = getattr(accelerator, "process_index", 0)
        kinds = [(kind, rank, self.box.first_errors.get(kind, "")) for kind in failures if kind not in self.said]
        if getattr(accelerator, "num_processes", 1) > 1:
            kinds, say = gather_object(kinds), accelerator.print  # each rank's reasons too
        ranks, reasons = {}, {}
        for kind, where, why in kinds:
            ranks.setdefault(kind, []).append(where)
            reasons.setdefault(kind, why)  # the lowest rank's
        for kind, where in ranks.items():
            self.said.add(kind)
            say(f"tool calls failed ({kind}) on rank{'s' * (len(where) > 1)} {', '.join(map(str, where))}: "
                f"{reasons[kind]}")
        self.box.calls, self.box.failures, self.environment_failures = 0, Counter(), Counter()
        return counts
