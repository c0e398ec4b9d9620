"""Arguments from dataclasses, optionally from a YAML file: `recipe.py [config.yaml] [--key value
...]`.

YAML values become the defaults and command-line flags override them. A YAML file is checked
before anything runs: an unknown key, or a value YAML typed differently from the field
(PyYAML reads `2e-5` as a string and a bare `no` as False), is an error that says what to write.
Values are checked too (`CheckedArgs`): a count of 0, a negative limit or a NaN is an error that
names the flag and what to write, before any model is built.
"""

import copy
import dataclasses
import difflib
import inspect
import io
import math
import re
import sys
import textwrap
import tokenize
import types
import typing
from typing import ClassVar

import yaml
from transformers import HfArgumentParser


def parse_args(dataclass_types, argv=None):
    """One instance per dataclass in `dataclass_types`, from `argv` (default: sys.argv[1:]), each
    checked alone (`CheckedArgs`) and then with the others (`CheckedArgs.check_with`). `--help`
    shows each flag's comment in its dataclass and its default."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _Parser(dataclass_types)
    if "-h" in argv or "--help" in argv:  # reading the comments parses each class's source: only for the help
        _document_flags(parser, dataclass_types)
    nullable = _nullable_fields(dataclass_types)
    for action in parser._actions:
        if action.dest in nullable:
            action.type = _none_or(action.type or str)
    if argv and argv[0].endswith((".yaml", ".yml")):
        with open(argv[0]) as file:
            values = yaml.safe_load(file) or {}
        values = {key: None if key in nullable and _is_none_word(value) else value for key, value in values.items()}
        check_yaml_values(values, dataclass_types, argv[0])
        parser.set_defaults(**values)
        argv = argv[1:]
    parsed = parser.parse_args_into_dataclasses(args=argv)
    for args in parsed:
        if isinstance(args, CheckedArgs):
            args.check_with({type(other): other for other in parsed})
    return parsed


def _document_flags(parser, dataclass_types):
    """Each flag's help: its field's comment, its choices and its default."""
    comments = {name: text for cls in dataclass_types for name, text in field_comments(cls).items()}
    comments |= {field.name: f"{comments.get(field.name, '')} (one of: {', '.join(field.metadata[CHOICES])})".lstrip()
                 for cls in dataclass_types for field in dataclasses.fields(cls) if CHOICES in field.metadata}
    fields = {field.name for cls in dataclass_types for field in dataclasses.fields(cls)}
    for action in parser._actions:
        if action.dest in fields:
            action.help = f"{comments.get(action.dest, '').replace('%', '%%')} (default: %(default)s)".lstrip()


class _Parser(HfArgumentParser):
    """HfArgumentParser, with each field's value rule (`checked`) kept out of argparse's keyword
    arguments."""

    @staticmethod
    def _parse_dataclass_field(parser, field: dataclasses.Field):
        # choices too: checked with the rules (YAML values never meet argparse's)
        if RULE in field.metadata:
            field = copy.copy(field)
            field.metadata = types.MappingProxyType({k: v for k, v in field.metadata.items()
                                                     if k not in (RULE, CHOICES)})
        HfArgumentParser._parse_dataclass_field(parser, field)


def _nullable_fields(dataclass_types) -> set[str]:
    """The fields that may be None: `None`, `none` and an empty value set them to None, on the
    command line and in YAML alike (what turns an evaluation, a limit or a source off)."""
    return {field.name for cls in dataclass_types for hints in [typing.get_type_hints(cls)]
            for field in dataclasses.fields(cls) if type(None) in _union_members(hints[field.name])}


def _is_none_word(value) -> bool:
    return isinstance(value, str) and value.strip().lower() in ("", "none")


def _none_or(convert):
    def parse(value):
        return None if _is_none_word(value) else convert(value)
    return parse


def field_comments(cls) -> dict[str, str]:
    """{field: its comment} from the dataclass's source (and its bases'): the comment lines right
    above the field, then the one after it on its line. The recipes document their flags this
    way."""
    comments = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines = textwrap.dedent(inspect.getsource(klass)).splitlines()
        except (OSError, TypeError):  # no source (an interactive session)
            continue
        fields, above = {field.name for field in dataclasses.fields(klass)}, []
        for line in lines:
            if line.strip().startswith("#"):
                above.append(line.strip().lstrip("#").strip())
                continue
            field = re.match(r" {4}(\w+)\s*:", line)
            if field and field[1] in fields and (text := " ".join([*above, _trailing_comment(line)]).strip()):
                comments[field[1]] = text
            above = []
    return comments


def _trailing_comment(line: str) -> str:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip()).readline))
    except (tokenize.TokenError, SyntaxError):  # a default that continues on the next line
        return ""
    return next((token.string.lstrip("#").strip() for token in tokens if token.type == tokenize.COMMENT), "")


def check_yaml_values(values: dict, dataclass_types, source: str):
    fields = {f.name: hints[f.name] for cls in dataclass_types for hints in [typing.get_type_hints(cls)]
              for f in dataclasses.fields(cls)}
    problems = []
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            problems.append(f"unknown key '{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        elif (problem := _type_problem(key, value, fields[key])) is not None:
            problems.append(problem)
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems))


def _type_problem(key, value, annotation):
    allowed = [t for t in _union_members(annotation) if t is not type(None)]
    if value is None:
        return None if type(None) in _union_members(annotation) else f"'{key}' may not be empty"
    kind = allowed[0] if len(allowed) == 1 else None
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return None
    if kind is float and isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return f"'{key}' must be a number, got '{value}'"
        return f"YAML read {key}: {value} as a string; write it with a dot and a signed exponent (e.g. 2.0e-5)"
    if kind is str and isinstance(value, bool):
        return f"YAML read {key} as the boolean {value}; quote it (e.g. '{'no' if value is False else 'yes'}')"
    if kind in (int, bool, str) and type(value) is not kind:
        return f"'{key}' must be {kind.__name__}, got {type(value).__name__} {value!r}"
    return None


def _union_members(annotation):
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _count(value, low: int) -> bool:
    return type(value) is int and value >= low


def _number(value, low: float, strict: bool) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value > low if strict else value >= low))


# rule name -> (test, what the value must be)
RULES = {
    "count": (lambda v: _count(v, 1), "a positive integer"),
    "count_or_none": (lambda v: v is None or _count(v, 1), "a positive integer, or unset"),
    "count_or_zero": (lambda v: _count(v, 0), "0 or a positive integer"),
    "count_or_zero_or_none": (lambda v: v is None or _count(v, 0), "0 or a positive integer, or unset"),
    "positive": (lambda v: _number(v, 0, True), "a finite number above 0"),
    "positive_or_none": (lambda v: v is None or _number(v, 0, True), "a finite number above 0, or unset"),
    "non_negative": (lambda v: _number(v, 0, False), "a finite number, 0 or more"),
    "non_negative_or_none": (lambda v: v is None or _number(v, 0, False), "a finite number, 0 or more, or unset"),
    "fraction": (lambda v: _number(v, 0, False) and v < 1, "a number from 0 up to (not including) 1"),
    "share": (lambda v: _number(v, 0, False) and v <= 1, "a number from 0 to 1"),
    "probability": (lambda v: _number(v, 0, True) and v <= 1, "a number above 0 and at most 1"),
    # SigLIP 2 NaFlex: attention grows with the square of an image's patches; published models use up to 1024
    "patches": (lambda v: v is None or (_count(v, 1) and v <= 4096), "a positive integer, at most 4096 (a 64 x 64 "
                "grid; attention grows with the square of it: 100,000 gave no step in 5 minutes), or unset"),
    # AdamW moves each weight by about the learning rate per step: above 1 nothing can train (1e30 trained to NaN)
    "learning_rate": (lambda v: _number(v, 0, True) and v <= 1, "a finite number above 0 and at most 1 (AdamW moves "
                      "each weight by about the learning rate per step)"),
}


RULE = "rule"  # the metadata key of a field's value rule
# the rule of a field whose value is one of its metadata's choices (argparse's `choices` too)
CHOICES = "choices"


def checked(default, rule: str | None = None, *, choices: tuple | None = None):
    """A dataclass field whose value must follow `rule` (a name in `RULES`) or be one of `choices`
    (--help lists them), beside the field it checks: a renamed field keeps its rule, and a subclass
    that only changes the default keeps it too (`CheckedArgs.rules`). Every flag is checked this
    way, from the command line and from YAML alike."""
    if choices is not None:
        return dataclasses.field(default=default, metadata={RULE: CHOICES, CHOICES: list(choices)})
    if rule not in RULES:
        raise KeyError(f"no value rule {rule!r}: one of {', '.join(RULES)}")
    return dataclasses.field(default=default, metadata={RULE: rule})


class CheckedArgs:
    """Mixin for argument dataclasses: each field made with `checked` is tested against its rule
    when the dataclass is built (HfArgumentParser builds it from flags and YAML), so a bad value
    stops the run before anything else happens."""

    # {flag: fields it makes unused}: a field changed from its default beside that flag is refused, not ignored
    UNUSED_WITH: ClassVar[dict[str, tuple[str, ...]]] = {}

    @classmethod
    def rules(cls) -> dict[str, tuple[str, list | None]]:
        """{field: (its rule, its choices)}: a field redefined in a subclass without a rule (a new
        default) keeps its base's."""
        rules = {}
        for klass in reversed(cls.__mro__):
            for field in getattr(klass, "__dataclass_fields__", {}).values():
                if RULE in field.metadata:
                    rules[field.name] = (field.metadata[RULE], field.metadata.get(CHOICES))
        return rules

    def __post_init__(self):
        problems = []
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        nullable = _nullable_fields([type(self)])
        for name, (rule, choices) in self.rules().items():
            test, expected = RULES[rule] if rule != CHOICES else (
                lambda value: value in choices or (value is None and name in nullable), f"one of {', '.join(choices)}")
            if not test(getattr(self, name)):
                default = defaults.get(name)
                example = f" (the default is {default})" if default not in (None, dataclasses.MISSING) else ""
                problems.append(f"--{name} {getattr(self, name)!r}: must be {expected}{example}")
        for flag, names in self.UNUSED_WITH.items():
            changed = [f"--{name} {getattr(self, name)!r}" for name in names if getattr(self, name) != defaults[name]]
            if getattr(self, flag) and changed:
                problems.append(f"{', '.join(changed)}: not used with --{flag}, whose own config decides (nothing is "
                                "resized or rebuilt); drop it")
        if problems:
            raise ValueError("; ".join(problems))

    def check_with(self, parsed: dict[type, "CheckedArgs"]):
        """Flags of this dataclass checked against another's (`parsed`: the recipe's other arguments
        by class), once every flag is parsed: none by default."""

    @staticmethod
    def other(parsed: dict[type, "CheckedArgs"], kind: type):
        """The parsed arguments of `kind` (or of a subclass of it)."""
        return next(args for cls, args in parsed.items() if issubclass(cls, kind))
