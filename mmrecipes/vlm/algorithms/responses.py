"""A model's turn read as its chat template writes one, in TRL 1.16's structure (`parse_response`):
`{"role": "assistant", "content": the answer, "reasoning_content": ..., "tool_calls": [...]}`.

The reading is transformers' own (`tokenizer.parse_response` with a `response_template`, given the
prompt the turn follows: a generation prompt that opened `<think>` counts). The template is the
checkpoint's own where its tokenizer ships one (Gemma 4's do), else found by rendering sentinels
through the chat template with the run's --chat_template_kwargs, never from a family's name:
- the assistant header and the think block: the text around a turn's `reasoning_content` (Qwen3's
  `<think>` ... `</think>`, Gemma 4's thought channel), cut where the block's first added token is;
- a tool call: the text the template writes for a call with two arguments (a string and an
  integer), read as JSON between two marks (Qwen2.5, Qwen3), as one tag per argument after the
  name (Qwen3.5, Qwen3.6: `<function=name>` `<parameter=key>`), or as `call:name{key:value}` with the
  template's own string quotes (Gemma 4);
- the answer: up to an end-of-turn token, or what the template ends a calling turn with where that is
  no end-of-turn token (Gemma 4's `<|tool_response>`: its results follow in the same turn, and a
  later turn is read from where they end, `after_results`).
Either way the sentinel turns must read back as they were written, or `ResponseFormat.of` refuses
the template, saying what did not read back.
"""

import json
import re

REASONING, ANSWER = "reasoning sentinel", "answer sentinel"
CALL = {"name": "tool_name_sentinel", "arguments": {"first_sentinel": "value sentinel", "second_sentinel": 7}}
SENTINEL_TOOL = {"type": "function", "function": {
    "name": CALL["name"], "description": "A sentinel.",
    "parameters": {"type": "object", "properties": {"first_sentinel": {"type": "string"},
                                                    "second_sentinel": {"type": "integer"}}}}}
USER = {"role": "user", "content": [{"type": "text", "text": "hi"}]}


def assistant(content: str, **fields) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": content}], **fields}


def calling(name: str, arguments: dict, again: bool = False) -> dict:
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return assistant("", tool_calls=[call, call] if again else [call])


class ResponseFormat:
    """How the template writes a model's turn (`template`: a transformers `response_template`), and
    what reads it back (`parse`)."""

    def __init__(self, tokenizer, template: dict, source: str, after_calls: str = ""):
        self.tokenizer, self.template, self.source = tokenizer, template, source
        # what the model ends a calling turn with, where not an end-of-turn token (Gemma 4: `<|tool_response>`)
        self.after_calls = after_calls

    @classmethod
    def of(cls, processor, stop_ids, template_kwargs=None, calls: bool = False) -> "ResponseFormat":
        """The checkpoint's `response_template` where its tokenizer has one, else one found by
        rendering (`stop_ids`: the tokens that end a turn); refused (ValueError) unless the sentinel
        turns read back (their tool calls too where `calls`: --tools)."""
        def render(messages, **kwargs):
            return processor.apply_chat_template(messages, **kwargs, **(template_kwargs or {}))

        tokenizer = processor.tokenizer
        stop_strings = [tokenizer.convert_ids_to_tokens(int(token)) for token in stop_ids]
        own = getattr(tokenizer, "response_template", None)
        try:
            template, after_calls = rendered_template(render, tokenizer, stop_strings, calls)
        except ValueError:
            if not own:
                raise
            template, after_calls = own, ""
        found = cls(tokenizer, own or template, "the checkpoint's response_template" if own else "found by rendering",
                    after_calls)
        found.check(render, calls)
        return found

    @property
    def structured(self) -> bool:
        """Whether the template writes reasoning or tool calls: a turn reads as more than its text."""
        return bool({"reasoning_content", "tool_calls"} & set(self.template.get("fields", {})))

    def parse(self, ids, prefix_ids, tools=None) -> dict:
        """The turn `ids` (the model's tokens after `prefix_ids`: its prompt and any earlier turns)
        as a message; one the template cannot read (a malformed call) is its text, as TRL falls
        back."""
        return self.read(ids, prefix_ids, tools)[0]

    def read(self, ids, prefix_ids, tools=None) -> tuple[dict, str | None]:
        """(`parse`'s message, why the template could not read the turn or None); `tools`: the
        schemas that type the calls' arguments."""
        try:
            message = self.tokenizer.parse_response(list(ids), self.template, prefix=list(prefix_ids), tools=tools)
            problem = None if isinstance(message, dict) else "nothing read"
        except (ValueError, TypeError, RecursionError) as error:  # RecursionError: JSON nested 1000 deep
            message, problem = None, f"{type(error).__name__}: {error}"
        if problem:
            return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}, problem
        message["content"] = message.get("content") or ""
        return message, None

    def cut_in_reasoning(self, message: dict, ids) -> bool:
        """Whether a turn `ids` read as `message` ends inside its reasoning: reasoning read, and the
        block never closed in the model's tokens."""
        close = self.template.get("fields", {}).get("reasoning_content", {}).get("close_pattern")
        return bool(close and message.get("reasoning_content")) and re.search(
            close, self.tokenizer.decode(ids)) is None

    def after_results(self, results_end: str):
        """A turn also begins where the template ends tool results without a new assistant header
        (Gemma 4 goes on after `<tool_response|>`): `results_end` or the header begins the turn a
        parse reads."""
        header = self.template.get("start_anchor")
        if header and results_end:
            anchors = "|".join(re.escape(anchor) for anchor in (header, results_end))
            self.template = {key: value for key, value in self.template.items() if key != "start_anchor"} | {
                "start_anchor_pattern": f"(?:{anchors})"}

    def calls_opened(self, text: str) -> bool:
        """Whether `text` opens a tool call as the template writes one."""
        field = self.template.get("fields", {}).get("tool_calls", {})
        opening = field.get("open_pattern") or re.escape(field.get("open") or "")
        return bool(opening) and re.search(opening.split("(?P<name>")[0], text) is not None

    def check(self, render, calls: bool):
        """Raise unless a rendered turn with reasoning reads back as its reasoning and answer, and
        (`calls`) one with a call as the call."""
        prompt = render([USER], add_generation_prompt=True)
        turns = {"a turn with reasoning": (assistant(ANSWER, reasoning_content=REASONING),
                                           {"reasoning_content": REASONING, "content": ANSWER})}
        if calls:
            turns["a tool call"] = (calling(**CALL), {"tool_calls": [{"type": "function", "function": CALL}]})
        for what, (message, expected) in turns.items():
            text = render([USER, message])
            if what == "a tool call" and not text.startswith(prompt):
                raise ValueError(f"the chat template writes a calling turn otherwise than after its generation prompt "
                                 f"{prompt[-40:]!r}: the calls would not follow what the model is given")
            if not text.startswith(prompt) or REASONING not in text and "reasoning_content" in expected:
                continue  # a template that writes no reasoning (or none in this mode) reads none
            ids, prefix = (self.tokenizer(part, add_special_tokens=False)["input_ids"]
                           for part in (text[len(prompt):], prompt))
            got = self.parse(ids, prefix, [SENTINEL_TOOL])
            if any(_stripped(got.get(key)) != _stripped(value) for key, value in expected.items()):
                raise ValueError(f"the chat template's turns cannot be read back ({self.source}): {what} rendered "
                                 f"as {text[len(prompt):]!r} reads as {got!r}")

    def describe(self) -> str:
        fields = self.template.get("fields", {})
        return (f"model turns read as the chat template writes them ({self.source}): "
                + ", ".join(name for name in ("reasoning_content", "tool_calls", "content") if name in fields))


def _stripped(value):
    return value.strip() if isinstance(value, str) else value


def rendered_template(render, tokenizer, stop_strings, calls: bool) -> tuple[dict, str]:
    """(a transformers `response_template` found by rendering sentinel turns (module docstring),
    what a calling turn ends with where the template ends it otherwise than an answer)."""
    before = render([USER])
    reasoned = render([USER, assistant(ANSWER, reasoning_content=REASONING)])[len(before):]
    plain = render([USER, assistant(ANSWER)])[len(before):]
    fields = {}
    if REASONING in reasoned and ANSWER in reasoned:
        lead = reasoned[:reasoned.index(REASONING)]
        cut = _last_added_token(tokenizer, lead)
        header, opening = lead[:cut], lead[cut:]
        closing = reasoned[reasoned.index(REASONING) + len(REASONING):reasoned.index(ANSWER)]
        fields["reasoning_content"] = {"open": opening.strip(), "close_pattern": _loose(closing.strip()) + r"\s*",
                                       "content": "text"}
    else:
        header = plain[:plain.index(ANSWER)] if ANSWER in plain else ""
    ends, after_calls = list(stop_strings), ""
    if calls:  # a calling turn may end otherwise (Gemma 4: `<|tool_response>`, where the results follow)
        fields["tool_calls"], after_calls = _call_field(render, tokenizer, before)
        ends += [after_calls] if after_calls else []
    ends = "|".join(re.escape(end) for end in sorted(set(ends), key=len, reverse=True))
    fields["content"] = {"close_pattern": rf"(?:{ends})\s*|$" if ends else "$", "content": "text"}
    template = {"defaults": {"role": "assistant"}, "fields": fields} | ({"start_anchor": header} if header else {})
    return template, after_calls


def _last_added_token(tokenizer, text: str) -> int:
    """Where the last of the tokenizer's added tokens in `text` begins (0: none): the think block
    begins with one (`<think>`, `<|channel>`), after the assistant header."""
    added = [token for token in tokenizer.get_added_vocab() if token and token in text]
    return max((text.rindex(token) for token in added), default=0)


def _loose(literal: str) -> str:
    """A pattern of `literal` where any run of whitespace matches any run."""
    return r"\s*".join(re.escape(part) for part in re.split(r"\s+", literal))


def _call_field(render, tokenizer, before: str) -> tuple[dict, str]:
    """(the `tool_calls` field of a response template, what the template ends a calling turn with
    after its calls), from the rendering of a call with two arguments: JSON between two marks, one
    tag per argument, or `name{key:value}` with the template's string quotes; ValueError for any
    other form."""
    empty = render([USER, assistant("")])[len(before):]
    once, twice = (_inserted(tokenizer, empty, render([USER, turn])[len(before):]).strip()
                   for turn in (calling(**CALL), calling(**CALL, again=True)))
    text = _shared_calls(once, twice).strip()  # less what ends a calling turn (Gemma 4's)
    after_calls = once[len(text):].strip()
    if CALL["name"] not in text:
        raise ValueError("the chat template does not write an assistant turn's tool calls")
    as_json = json.dumps(CALL)
    if as_json in text:  # Qwen2.5 / Qwen3: {"name": ..., "arguments": ...} between two marks
        start = text.index(as_json)
        if not text[:start].strip() or not text[start + len(as_json):].strip():
            raise ValueError(f"the chat template writes a tool call without marks around it ({text!r}): it cannot be "
                             "told from an answer")
        field = {"open": text[:start].strip(), "close_pattern": _loose(text[start + len(as_json):].strip()) + r"\s*",
                 "repeats": True, "content": "json", "transform": {"type": "function", "function": "{content}"}}
        return field, after_calls
    opening, rest = text.split(CALL["name"], 1)
    closing = text[text.rfind("<"):] if text.endswith(">") else ""  # the call's last tag
    body = rest[:len(rest) - len(closing)]
    first, second = CALL["arguments"]
    if not all(key in body for key in (first, second)) or not opening.strip() or not closing.strip():
        raise ValueError(f"the chat template writes a tool call as {text!r}, not a form read here (JSON between "
                         "two marks, one tag per argument, or name{key: value})")
    string = body[body.index(first) + len(first):body.index(CALL["arguments"][first])]
    number = body[body.index(second) + len(second):body.rindex(str(CALL["arguments"][second]))]
    named = {"open_pattern": _loose(opening.strip()) + r"(?P<name>\w+)", "close_pattern": _loose(closing.strip())
             + r"\s*", "repeats": True,
             "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}}
    if body.strip().startswith("{"):  # Gemma 4: call:name{key:<|"|>text<|"|>,key:7}
        quote = string[len(number):]
        closing_quote = body[body.index(CALL["arguments"][first]) + len(CALL["arguments"][first]):][:len(quote)]
        args = {"unquoted_keys": f'"{first}"' not in body} | (
            {"string_delims": [[quote, closing_quote]]} if quote and quote != '"' else {})
        return named | {"content": "json", "content_args": args}, after_calls
    # one tag per argument (Qwen3.5): the text before each key and after each value, shared by both
    after_value = _common_prefix(body[body.index(CALL["arguments"][first]) + len(CALL["arguments"][first]):],
                                 body[body.rindex(str(CALL["arguments"][second])) + 1:])
    after_value = after_value[:after_value.rfind(">") + 1] if ">" in after_value else after_value.rstrip()
    before_key = _common_suffix(body[:body.index(first)], body[:body.index(second)])
    before_key = before_key[before_key.rfind("<"):] if "<" in before_key else before_key.lstrip()  # its own tag
    lead = body[:body.index(first) - len(before_key)].strip()
    tag = (_loose(before_key) + r"(?P<key>\w+)" + _loose(string.strip()) + r"\s*(?P<value>.*?)\s*"
           + _loose(after_value.strip()))
    return named | {"open_pattern": named["open_pattern"] + _loose(lead), "content": "xml-inline",
                    "content_args": {"tag_pattern": tag, "value_parser": {"name": "text"}}}, after_calls


def _shared_calls(once: str, twice: str) -> str:
    """The text `once` (a turn's one call) and `twice` (two) begin with alike, ending with a whole
    tag: the first call with its closing mark."""
    shared = _common_prefix(once, twice)
    return shared if shared == once else shared[:shared.rfind(">") + 1]


def _inserted(tokenizer, shorter: str, longer: str) -> str:
    """What `longer` inserts into `shorter`, by their tokens (a mark such as `<tool_call>` is one
    token, so a shared first character never splits it)."""
    a, b = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in (shorter, longer))
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    return tokenizer.decode(b[head:len(b) - tail])


def _common_prefix(a: str, b: str) -> str:
    size = 0
    while size < min(len(a), len(b)) and a[size] == b[size]:
        size += 1
    return a[:size]


def _common_suffix(a: str, b: str) -> str:
    return _common_prefix(a[::-1], b[::-1])[::-1]
