"""`--chat_template_kwargs`: variables a run passes to every rendering of its chat template (TRL's
`chat_template_kwargs`): Qwen3's and Gemma 4's `enable_thinking`, Qwen3.6's `preserve_thinking`,
gpt-oss's `reasoning_effort`. A template reads only the names it was written with: a key it never
reads changes nothing (and `apply_chat_template` hands such a key to the processor instead), so it
is refused before the first step, with the options the template does read."""

import json
import re

import jinja2
import jinja2.meta

# What a rendering is always given (transformers' `apply_chat_template` sets these itself): no
# kwarg may replace them
RENDERING_OWN = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                           "raise_exception", "strftime_now"})
# the `{% generation %}` blocks of training templates: transformers' own tag, not plain Jinja
_GENERATION_TAGS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


def parse_template_kwargs(value, flag: str = "--chat_template_kwargs") -> dict | None:
    """A JSON object on the command line, or a mapping in YAML, as a dict (None: none)."""
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{flag}: not JSON ({error}); write an object, e.g. "
                             "'{\"enable_thinking\": false}'") from None
    if parsed is not None and not isinstance(parsed, dict):
        raise ValueError(f"{flag}: {type(parsed).__name__} {parsed!r} is not a mapping; write an object, e.g. "
                         "'{\"enable_thinking\": false}'")
    if parsed and (own := sorted(set(parsed) & RENDERING_OWN)):
        raise ValueError(f"{flag}: {', '.join(own)} {'is' if len(own) == 1 else 'are'} set by the recipe at each "
                         "rendering, not a template option")
    return parsed or None


def template_variables(template: str, special_tokens=()) -> tuple[set[str], set[str]]:
    """(the names `template` may read from what a rendering gives it, by Jinja's own analysis of its
    source; the options among them: those it never assigns itself, or assigns from themselves, as
    Gemma 4's `enable_thinking | default(false)`), less what every rendering gives (the
    conversation, the tools, the special tokens)."""
    parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(_GENERATION_TAGS.sub("", template))
    read = set(jinja2.meta.find_undeclared_variables(parsed)) - RENDERING_OWN - set(special_tokens)
    assigned, defaulted = set(), set()
    for node in parsed.find_all((jinja2.nodes.Assign, jinja2.nodes.AssignBlock, jinja2.nodes.For)):
        names = {name.name for name in node.target.find_all(jinja2.nodes.Name)} | (
            {node.target.name} if isinstance(node.target, jinja2.nodes.Name) else set())
        assigned |= names
        if isinstance(node, jinja2.nodes.Assign):
            defaulted |= names & {name.name for name in node.node.find_all(jinja2.nodes.Name)}
    return read, {name for name in read if name not in assigned or name in defaulted}


def check_template_kwargs(kwargs: dict | None, template: str, special_tokens=(),
                          flag: str = "--chat_template_kwargs") -> str:
    """Raise for a key `template` never reads; else the log's words for what the renderings get."""
    if not kwargs:
        return ""
    if not isinstance(template, str):
        raise ValueError(f"{flag}: the processor has no chat template (or several) to read them")
    read, options = template_variables(template, special_tokens)
    if unread := sorted(set(kwargs) - read):
        reads = ", ".join(sorted(options)) or "none beyond the conversation and its tools"
        raise ValueError(f"{flag}: the chat template never reads {', '.join(unread)}, so "
                         f"{'it changes' if len(unread) == 1 else 'they change'} nothing; the options it reads: "
                         f"{reads}")
    return f"rendered with {json.dumps(kwargs, sort_keys=True)} ({flag})"
