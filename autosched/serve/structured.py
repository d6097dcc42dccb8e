"""Structured output in the OpenAI API: what a request's fields ask the output to follow (a
:class:`~autosched.generation.grammar.GrammarSpec`), and tool calls.

Fields, one at most a request: OpenAI's ``response_format`` (``{"type": "json_object"}``, ``{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}``, ``{"type": "text"}``), vLLM's ``guided_json``,
``guided_regex``, ``guided_grammar`` (XGrammar's EBNF), ``guided_choice``, and vLLM's newer
``structured_outputs: {"json" | "regex" | "grammar" | "choice" | "json_object"}``.

Tool calls (``tools`` and ``tool_choice`` of ``/v1/chat/completions``). The tools go to the chat template
(``tool_choice: "none"``: they do not). The call format is JSON, as vLLM's for ``required``:

- ``tool_choice: "required"``: the output is held to a JSON array of calls ``[{"name": ..., "arguments":
  {...}}]`` (one or more; one with ``parallel_tool_calls: false``), each call's arguments to its function's
  ``parameters`` schema;
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is held to that function's
  ``parameters`` schema, and is the call's arguments;
- ``auto`` (the default with tools): nothing is held; an output that is a call (a JSON object with ``name``, one
  of the tools, and ``arguments`` or ``parameters``, an object; or a list of them; each possibly wrapped in
  ``<tool_call>...</tool_call>`` as Hermes-style templates ask) is read as one, any other output is text.

Parsed calls become ``message.tool_calls`` (``id`` ``call_...``, ``type`` ``function``, the name, the arguments as
a JSON string) with ``finish_reason: "tool_calls"``; streamed, the text that may be a call is held back and the
calls go out in one ``delta.tool_calls`` when the output ends.
"""

from __future__ import annotations

import json
import re
import uuid

from autosched.generation.grammar import GrammarError, GrammarSpec


class StructuredError(ValueError):
    """A request whose structured-output fields are wrong: the message and the field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def request_grammar(body) -> GrammarSpec | None:
    """What the output of ``body`` (a completion or chat request) must follow, from its structured-output
    fields; None for free text."""
    asked = []
    if body.response_format is not None:
        spec = _response_format(body.response_format)
        if spec is not None:
            asked.append(("response_format", spec))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_grammar", "grammar"),
                       ("guided_choice", "choice")):
        value = getattr(body, name)
        if value is not None:
            asked.append((name, _spec(kind, value, name)))
    if body.structured_outputs is not None:
        given = {k: v for k, v in body.structured_outputs.items() if v is not None and v is not False}
        known = [k for k in given if k in ("json", "regex", "grammar", "choice", "json_object")]
        if len(known) != 1 or len(given) != 1:
            raise StructuredError("structured_outputs takes one of json, regex, grammar, choice or json_object",
                                  "structured_outputs")
        kind = known[0]
        asked.append((f"structured_outputs.{kind}", _spec(kind, given[kind], f"structured_outputs.{kind}")))
    if len(asked) > 1:
        raise StructuredError(f"{asked[0][0]} and {asked[1][0]} both constrain the output: give one of them",
                              asked[1][0])
    return asked[0][1] if asked else None


def _response_format(value) -> GrammarSpec | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise StructuredError("response_format.type is text, json_object or json_schema", "response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return GrammarSpec.json_object()
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or "schema" not in inner:
        raise StructuredError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}',
                              "response_format.json_schema")
    return _spec("json", inner["schema"], "response_format.json_schema.schema")


def _spec(kind: str, value, param: str) -> GrammarSpec:
    try:
        if kind == "json":
            return GrammarSpec.json_schema(value)
        if kind == "json_object":
            return GrammarSpec.json_object()
        if kind == "choice":
            return GrammarSpec.choice(value)
        if not isinstance(value, str) or not value:
            raise GrammarError(f"{param} is a non-empty string")
        return GrammarSpec.regex(value) if kind == "regex" else GrammarSpec.ebnf(value)
    except GrammarError as exc:
        raise StructuredError(str(exc), param) from None


# ---- tools -------------------------------------------------------------------------------------------------

class ToolPlan:
    """What a chat request's ``tools`` and ``tool_choice`` make of it: the tools for the template (None: none),
    the grammar of the output (None: free) and how the output is read (``mode``: ``none``, ``auto``,
    ``required`` or ``named``)."""

    def __init__(self, tools, tool_choice, parallel: bool | None):
        self.functions: dict[str, dict] = {}
        for i, tool in enumerate(tools or []):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str) or not function["name"]:
                raise StructuredError('each tool is {"type": "function", "function": {"name": ..., "parameters": '
                                      '{...}}}', f"tools.{i}")
            parameters = function.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise StructuredError(f"tools.{i}.function.parameters is a JSON schema (an object)",
                                      f"tools.{i}.function.parameters")
            if function["name"] in self.functions:
                raise StructuredError(f"two tools are named {function['name']!r}", f"tools.{i}")
            self.functions[function["name"]] = parameters or {"type": "object"}
        choice = tool_choice if tool_choice is not None else ("auto" if self.functions else "none")
        self.grammar = None
        self.named = None
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if not isinstance(name, str):
                raise StructuredError('a named tool_choice is {"type": "function", "function": {"name": ...}}',
                                      "tool_choice")
            if name not in self.functions:
                raise StructuredError(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
            self.mode, self.named = "named", name
            self.grammar = _spec("json", self.functions[name], "tools")
        elif choice in ("none", "auto", "required"):
            self.mode = choice
            if choice != "none" and not self.functions:
                raise StructuredError(f"tool_choice {choice!r} needs tools", "tool_choice")
            if choice == "required":
                calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                          "required": ["name", "arguments"]} for name, schema in self.functions.items()]
                array = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
                if parallel is False:
                    array["maxItems"] = 1
                self.grammar = _spec("json", array, "tools")
        else:
            raise StructuredError('tool_choice is "none", "auto", "required" or {"type": "function", "function": '
                                  '{"name": ...}}', "tool_choice")
        self.template_tools = tools if self.functions and self.mode != "none" else None

    @property
    def reads_calls(self) -> bool:
        return self.mode != "none"

    def calls(self, text: str) -> list[dict] | None:
        """The tool calls of an output (OpenAI's ``tool_calls``), or None where it is not a call."""
        if self.mode == "named":
            try:
                arguments = json.loads(text)
            except ValueError:
                return None
            return [_call(self.named, arguments)] if isinstance(arguments, dict) else None
        if self.mode == "none":
            return None
        return parse_calls(text, self.functions)

    def may_be_call(self, text: str) -> bool:
        """Whether streamed text so far could still turn out a call (then it is held back)."""
        if self.mode in ("named", "required"):
            return True
        if self.mode == "none":
            return False
        start = text.lstrip()
        return not start or start[0] in "[{" or TOOL_CALL_OPEN.startswith(start[:len(TOOL_CALL_OPEN)])


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def parse_calls(text: str, functions: dict) -> list[dict] | None:
    """The calls of ``text`` (see the module) to the functions named in ``functions``; None where it is not
    calls alone."""
    text = text.strip()
    if text.startswith(TOOL_CALL_OPEN):
        parts = re.findall(rf"{re.escape(TOOL_CALL_OPEN)}(.*?){re.escape(TOOL_CALL_CLOSE)}", text, re.S)
        rest = re.sub(rf"{re.escape(TOOL_CALL_OPEN)}.*?{re.escape(TOOL_CALL_CLOSE)}", "", text, flags=re.S)
        if not parts or rest.strip():
            return None
        texts = parts
    else:
        texts = [text]
    calls = []
    for part in texts:
        try:
            value = json.loads(part)
        except ValueError:
            return None
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict) or item.get("name") not in functions:
                return None
            arguments = item.get("arguments", item.get("parameters"))
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    return None
            if not isinstance(arguments, dict):
                return None
            calls.append(_call(item["name"], arguments))
    return calls or None


def _call(name: str, arguments: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def template_message(message: dict) -> dict:
    """A chat message for the template: an assistant's ``tool_calls`` with their arguments as objects (the
    API sends them as JSON strings; templates write them out, as vLLM gives them)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function = function | {"arguments": json.loads(function["arguments"])}
            except ValueError:
                pass
            call = call | {"function": function}
        out.append(call)
    return message | {"tool_calls": out}
