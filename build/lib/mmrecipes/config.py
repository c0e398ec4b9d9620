"""Arguments from dataclasses, optionally from a YAML file: `recipe.py [config.yaml] [--key value ...]`.

YAML values become the defaults and command-line flags override them. A YAML file is checked
before anything runs: an unknown key, or a value YAML typed differently from the field
(PyYAML reads `2e-5` as a string and a bare `no` as False), is an error that says what to write.
"""

import dataclasses
import difflib
import sys
import types
import typing

import yaml
from transformers import HfArgumentParser


def parse_args(dataclass_types, argv=None):
    """One instance per dataclass in `dataclass_types`, from `argv` (default: sys.argv[1:])."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser(dataclass_types)
    if argv and argv[0].endswith((".yaml", ".yml")):
        with open(argv[0]) as file:
            values = yaml.safe_load(file) or {}
        check_yaml_values(values, dataclass_types, argv[0])
        parser.set_defaults(**values)
        argv = argv[1:]
    return parser.parse_args_into_dataclasses(args=argv)


def check_yaml_values(values: dict, dataclass_types, source: str):
    fields = {f.name: typing.get_type_hints(cls)[f.name] for cls in dataclass_types for f in dataclasses.fields(cls)}
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
    if kind in (int, bool, str) and not (type(value) is kind):
        return f"'{key}' must be {kind.__name__}, got {type(value).__name__} {value!r}"
    return None


def _union_members(annotation):
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)
