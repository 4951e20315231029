"""The config keys as `--help` lists them: read from the section dataclasses, so the list cannot drift.

Each section dataclass documents its keys in an ``Attributes:`` block of its docstring, one
``name: description`` per key (continuation lines indented deeper); types and defaults come from
the fields themselves.
"""
from __future__ import annotations

import inspect
import json
import re
import types
import typing
from typing import Any

from moe_train.config import SECTIONS, Config, _section_types


def key_descriptions(cls: type) -> dict[str, str]:
    """{key: one-line description} from the ``Attributes:`` block of ``cls``'s docstring."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    if "Attributes:" not in lines:
        return {}
    descriptions: dict[str, str] = {}
    key = None
    for line in lines[lines.index("Attributes:") + 1:]:
        entry = re.match(r"^    (\w+): (.*)$", line)
        if entry:
            key = entry.group(1)
            descriptions[key] = entry.group(2).strip()
        elif line.startswith("      ") and key is not None:
            descriptions[key] += " " + line.strip()
        elif line.strip():
            break
    return descriptions


def type_label(annotation: Any) -> str:
    """A field type as YAML users write it: int, float | null, str | list of str | null, ..."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join(type_label(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        return f"list of {type_label(typing.get_args(annotation)[0])}"
    return "null" if annotation is type(None) else annotation.__name__


def config_keys_help() -> str:
    """Every config key, grouped by section: `section.key (type, default D): description`."""
    defaults = Config()
    out = ["config keys (YAML sections, or --set section.key=value):"]
    for section in SECTIONS:
        cls = type(getattr(defaults, section))
        summary = inspect.cleandoc(cls.__doc__ or "").splitlines()[:1]
        out.append(f"\n{section}: {summary[0] if summary else ''}")
        descriptions = key_descriptions(cls)
        for key, annotation in _section_types(section).items():
            default = json.dumps(getattr(getattr(defaults, section), key))
            out.append(f"  {section}.{key} ({type_label(annotation)}, default {default}): {descriptions.get(key, '')}")
    return "\n".join(out)
