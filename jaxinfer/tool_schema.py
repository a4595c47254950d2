"""Python functions as tool descriptions for chat templates.

A chat template that supports tool use (Llama 3.1, Qwen 2.5/3, Mistral, ...) is given `tools`: a list
of JSON-schema function descriptions, `{"type": "function", "function": {"name", "description",
"parameters"}}`, which it writes into the prompt. `LLM.chat(tools=...)` takes those dicts as they are
(the form vLLM and the OpenAI API take) or plain Python functions, which `function_schema` describes
from their type hints and a Google-style docstring - the same schema transformers'
`get_json_schema` writes for them (compared in tests/test_tokenizer.py), so a prompt rendered here
equals `apply_chat_template(..., tools=[fn])`. The docstring is read by its sections, and in a few
shapes transformers' parser reads it differently; ours keeps the sections apart there:

- a section transformers does not know (`Examples:`, `Note:`) or a closing paragraph: transformers
  appends it to the last argument's (or the return's) description;
- `Returns: text` on the header's own line: transformers drops the text;
- `Args:` inside a summary line: transformers cuts the summary there.

A torch.Tensor or PIL image hint (transformers' "audio" / "image") is refused.

    def get_weather(city: str, unit: Literal["C", "F"] = "C") -> float:
        '''Current temperature in a city.

        Args:
            city: the city's name
            unit: the temperature scale
        '''

Every argument needs a type hint and a line under `Args:`. A description ending in
`(choices: ["a", "b"])` (a JSON list) becomes the argument's `enum`.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from typing import Any

from jaxinfer.errors import InvalidRequestError

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE = {**_SCALARS, list: "array", tuple: "array", dict: "object"}  # unparameterised types

# A Google-style section header: its name and a colon at the docstring's outer indentation (where
# `inspect.getdoc` leaves it), text after it on the same line allowed. A section runs until the next
# line back at that indentation.
_SECTION = re.compile(
    r"^(Args|Arguments|Returns?|Raises|Yields|Examples?|Notes?|Warnings?|See Also|Todo|Attributes|References"
    r"|Keyword Args|Keyword Arguments|Other Parameters):[ \t]*(.*)$",
    re.MULTILINE,
)
# One argument's first line inside Args: "name: text" or "name (type): text".
_ARG_LINE = re.compile(r"^(\s*)(\w+)(?:\s*\([^()\n]*\))?:\s*(.*)$")
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE | re.DOTALL)


def function_schema(func) -> dict:
    """The tool description of a Python function (see the module docstring).

    Raises:
        InvalidRequestError: no docstring, an argument without a type hint or a description, or a
            type hint with no JSON equivalent (a custom class: write that tool's schema by hand).
    """
    name = getattr(func, "__name__", "operation")
    doc = inspect.getdoc(func)
    if not doc:
        raise InvalidRequestError(f"tool {name!r} has no docstring: its description and Args: section come from it")
    description, arg_docs, returns_doc = _parse_docstring(doc.strip())
    try:
        hints = typing.get_type_hints(func)
    except Exception as e:  # a hint naming a type that does not resolve
        raise InvalidRequestError(f"tool {name!r}: its type hints do not resolve ({type(e).__name__}: {e})") from None
    params = list(inspect.signature(func).parameters.values())
    if params and params[0].name in ("self", "cls") and params[0].annotation is inspect.Parameter.empty:
        params = params[1:]  # the receiver of a method
    if missing := [p.name for p in params if p.name not in hints]:
        raise InvalidRequestError(f"tool {name!r}: argument {missing[0]!r} has no type hint")
    properties = {}
    required = [p.name for p in params if p.default is inspect.Parameter.empty]
    for arg in (p.name for p in params):
        schema = _type_schema(hints[arg], f"tool {name!r}: argument {arg!r}")
        if arg not in arg_docs:
            raise InvalidRequestError(
                f"tool {name!r}: argument {arg!r} has no description under Args: in the docstring"
            )
        text = arg_docs[arg]
        if m := _CHOICES.search(text):
            try:
                choices = json.loads(m.group(1))
            except json.JSONDecodeError:
                choices = None
            if not isinstance(choices, list):
                raise InvalidRequestError(
                    f"tool {name!r}: argument {arg!r}: '(choices: ...)' must hold a JSON list, got {m.group(1)!r}"
                )
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in choices]
            text = text[: m.start()].strip()
        schema["description"] = text
        properties[arg] = schema
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:
        try:  # the model never writes the return value: a hint with no JSON form is left out
            function["return"] = _type_schema(hints["return"], "")
        except InvalidRequestError:
            pass
        else:
            if returns_doc is not None:
                function["return"]["description"] = returns_doc
    return {"type": "function", "function": function}


def _parse_docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """(description, {argument: description}, returns) of a Google-style docstring."""
    headers = list(_SECTION.finditer(doc))
    description = doc[: headers[0].start()].strip() if headers else doc
    sections: dict[str, list[str]] = {}
    for h in headers:
        lines = [h.group(2)] if h.group(2).strip() else []
        for line in doc[h.end() :].splitlines()[1:]:
            if line.strip() and not line[0].isspace():
                break  # back at the outer indentation: the next section, or a closing paragraph
            lines.append(line)
        name = {"Arguments": "Args", "Return": "Returns"}.get(h.group(1), h.group(1))
        sections.setdefault(name, lines)
    returns = "\n".join(sections["Returns"]).strip() if "Returns" in sections else None
    args: dict[str, str] = {}
    current, indent = None, 0
    for line in sections.get("Args", []):
        m = _ARG_LINE.match(line)
        if m and (current is None or len(m.group(1)) <= indent):  # a new argument
            current, indent = m.group(2), len(m.group(1))
            args[current] = m.group(3).strip()
        elif current is not None and line.strip():  # deeper lines continue the last one
            args[current] = f"{args[current]} {line.strip()}".strip()
    return description, args, returns


def _enum_schema(values: list, where: str) -> dict:
    if not values:
        raise InvalidRequestError(f"{where}: an enumeration with no values cannot be matched")
    if bad := [v for v in values if type(v) not in _SCALARS]:
        raise InvalidRequestError(f"{where}: enumeration values must be JSON scalars, got {bad!r}")
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(values)}


def _type_schema(hint, where: str) -> dict:
    """The JSON schema of one type hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return {}
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum_schema([m.value for m in hint], where)
        if isinstance(hint, type) and hint in _BARE:
            return {"type": _BARE[hint]}
        raise InvalidRequestError(
            f"{where}: type hint {hint!r} has no JSON schema (basic types, Enum, Literal, list, tuple, dict and "
            "unions of them do); pass this tool as a schema dict instead"
        )
    if origin is typing.Union or origin is types.UnionType:
        options = [_type_schema(a, where) for a in args if a is not type(None)]
        if len(options) == 1:
            out = options[0]
        elif all(o.keys() == {"type"} and isinstance(o["type"], str) for o in options):
            kinds = sorted({o["type"] for o in options})
            out = {"type": kinds[0] if len(kinds) == 1 else kinds}
        else:
            out = {"anyOf": options}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is typing.Literal:
        return _enum_schema(list(args), where)
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0], where)} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise InvalidRequestError(
                f"{where}: {hint} has no fixed-length JSON form (a one-element or open tuple): use list[...]"
            )
        return {"type": "array", "prefixItems": [_type_schema(a, where) for a in args]}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _type_schema(args[1], where)
        return out
    raise InvalidRequestError(
        f"{where}: type hint {hint!r} has no JSON schema; pass this tool as a schema dict instead"
    )
