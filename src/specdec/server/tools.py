"""Function calling: a request's tools through the model's chat template, the grammar that forces a
call, and the parser that reads calls out of the answer's text.

One envelope throughout, the one Qwen2.5's template teaches (the Hermes format)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that renders the ``tools`` it is given and names ``<tool_call>`` in them (Qwen2.5's)
gets the tools, the history's ``tool_calls`` and ``tool`` messages as Hugging Face's chat
templates take them. Any other template (SmolLM2's ignores ``tools``) gets them in a generic form:
the tool list and the envelope in a system message (:data:`GENERIC_TOOLS_PROMPT`, the same words
Qwen2.5's template uses), an earlier call as the envelope in the assistant's text, and a tool's
result as a user message inside ``<tool_response>`` tags.

With ``tool_choice`` ``required`` or a named function, the answer is constrained by an llguidance
Lark grammar (:func:`tool_grammar`): the envelope around a JSON object whose ``name`` is the
function's and whose ``arguments`` follow its ``parameters`` schema. :class:`ToolCallParser`
reads the text as it streams: text outside the envelope is content, a call becomes its name as
soon as that is read and then its arguments, piece by piece, exactly as the model wrote them.
A whole answer is parsed by the same parser fed at once, so the streamed deltas add up to the
whole answer's ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

OPEN, CLOSE, NL = "<tool_call>", "</tool_call>", "\n"

GENERIC_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

_PROBE_USER = {"role": "user", "content": "x"}
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_name", "description": "d",
                                                  "parameters": {"type": "object", "properties": {}}}}


_TAKES_TOOLS: dict[str, bool] = {}  # chat template text -> template_takes_tools


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders the ``tools`` it is given in the
    ``<tool_call>`` envelope (Qwen2.5's does; SmolLM2's ignores them). Asked once per template."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        return False
    if template not in _TAKES_TOOLS:
        try:
            shown = tokenizer.apply_chat_template([_PROBE_USER], tools=[_PROBE_TOOL], tokenize=False,
                                                  add_generation_prompt=True)
            _TAKES_TOOLS[template] = "probe_tool_name" in shown and OPEN in shown
        except Exception:  # a template that fails on tools does not take them
            _TAKES_TOOLS[template] = False
    return _TAKES_TOOLS[template]


def envelope(name: str, arguments: Any) -> str:
    """A call as the model writes it (``arguments``: a JSON object, or its text)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{CLOSE}'


def template_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                      native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (OpenAI's form, ``tool_calls`` with ``arguments`` as JSON text already checked to
    parse) and tools as the chat template is given them: ``(messages, tools)``; tools None where
    the template is not given any (none asked for, or the generic form put them in a message)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if native:
            if calls:
                m = {**m, "content": m.get("content") or "", "tool_calls": [
                    {"type": "function", **({"id": c["id"]} if c.get("id") else {}),
                     "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                    for c in calls]}
            out.append(m)
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        elif calls:
            text = "\n".join([*([m["content"]] if m.get("content") else []),
                              *(envelope(c["function"]["name"], c["function"]["arguments"]) for c in calls)])
            out.append({"role": m["role"], "content": text})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    if not tools or native:
        return out, list(tools) if tools else None
    listing = GENERIC_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{listing}"}
    else:
        out.insert(0, {"role": "system", "content": listing})
    return out, None


# The envelope's JSON is written as the templates show it: ", " and ": " between items, no other
# whitespace; so everything from "<tool_call>" to the first argument's value is forced.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_schema(function: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call's object: the function's name, then its arguments. The
    parameters' own definitions (``$defs``, as pydantic writes nested models) move to ``defs``,
    named ``<function>__<name>``, to be the whole schema's: a ``#/$defs/...`` reference means
    the root of the schema it is in."""
    parameters = dict(function.get("parameters") or {"type": "object"})
    prefix = f"{function['name']}__"
    for key in ("$defs", "definitions"):
        for name, definition in (parameters.pop(key, None) or {}).items():
            defs[prefix + name] = _prefixed_refs(definition, prefix)
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": _prefixed_refs(parameters, prefix)},
            "required": ["name", "arguments"], "additionalProperties": False}


def _prefixed_refs(node: Any, prefix: str) -> Any:
    """``node`` with its references to ``#/$defs/X`` (or ``#/definitions/X``) made ``#/$defs/<prefix>X``."""
    if isinstance(node, list):
        return [_prefixed_refs(item, prefix) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _prefixed_refs(value, prefix) for key, value in node.items()}
    ref = node.get("$ref")
    for root in ("#/$defs/", "#/definitions/"):
        if isinstance(ref, str) and ref.startswith(root):
            out["$ref"] = "#/$defs/" + prefix + ref[len(root):]
    return out


def tool_grammar(functions: Sequence[dict[str, Any]], *, several: bool, content_schema: Any = None) -> str:
    """An llguidance Lark grammar for one call of one of ``functions`` (several calls, one a line,
    with ``several``), in the envelope. With ``content_schema`` (a JSON schema), the answer may
    instead be a JSON value of that schema (``tool_choice`` ``auto`` with a ``response_format``)."""
    defs: dict[str, Any] = {}
    calls = [call_schema(f, defs) for f in functions]
    schema = {"x-guidance": JSON_LAYOUT, **(calls[0] if len(calls) == 1 else {"anyOf": calls}),
              **({"$defs": defs} if defs else {})}
    repeat = ' ("\\n" call)*' if several else ""
    lines = [f"calls: call{repeat}",
             f"call: {json.dumps(OPEN + NL)} args {json.dumps(NL + CLOSE)}",
             f"args: %json{json.dumps(schema)}"]
    if content_schema is None:
        return "\n".join(["start: calls", *lines]) + "\n"
    return "\n".join(["start: calls | content", *lines, f"content: %json{json.dumps(content_schema)}"]) + "\n"


# ------------------------------------------------------------------------------------------------
# Reading calls out of the text

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallParser:
    """Splits an answer's text, fed piece by piece, into content and calls.

    :meth:`feed` returns the deltas the new text settles: ``("content", text)``,
    ``("call", index)`` (a call's name is known: ``calls[index]``), ``("arguments", index, text)``.
    Text that may still begin the envelope is held back; inside a call, the arguments are released
    as they arrive, up to where their JSON value ends. A call in another shape (its keys in another
    order) is released whole when its envelope closes; an envelope that holds no call is content.
    """

    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    _buf: str = ""
    _state: str = "text"  # text, head (inside the envelope, before the arguments), args, tail
    _depth: int = 0  # the arguments' JSON nesting; in_string and escape below
    _in_string: bool = False
    _escape: bool = False
    _started: bool = False
    _scalar: bool = False
    _after_call: bool = False  # the text since an envelope closed is all whitespace

    def feed(self, text: str) -> list[tuple]:
        self._buf += text
        out: list[tuple] = []
        while True:
            before = (self._state, len(self._buf))
            getattr(self, f"_{self._state}")(out, final=False)
            if (self._state, len(self._buf)) == before:
                return self._merged(out)

    def finish(self) -> list[tuple]:
        """The deltas of what is still held (the text ended)."""
        out: list[tuple] = []
        if self._state == "text":
            self._text(out, final=True)
            self._emit_content(out, self._buf)
        elif self._state == "head":
            self._emit_content(out, OPEN + self._buf)
        elif self._state == "args":
            self._emit_args(out, self._buf)
        self._buf, self._state = "", "text"
        return self._merged(out)

    def _merged(self, out: list[tuple]) -> list[tuple]:
        merged: list[tuple] = []
        for d in out:
            if merged and d[0] != "call" and merged[-1][0] == d[0] and merged[-1][:-1] == d[:-1]:
                merged[-1] = (*d[:-1], merged[-1][-1] + d[-1])
            elif d[-1] != "" or d[0] == "call":
                merged.append(d)
        return merged

    def _emit_content(self, out: list[tuple], text: str) -> None:
        self.content += text
        out.append(("content", text))

    def _emit_args(self, out: list[tuple], text: str) -> None:
        self.calls[-1].arguments += text
        out.append(("arguments", len(self.calls) - 1, text))

    def _text(self, out: list[tuple], final: bool) -> None:
        """Content, up to an envelope; whitespace next to an envelope is dropped, so it is held."""
        if self._after_call:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return
            self._after_call = False
        at = self._buf.find(OPEN)
        if at >= 0:
            self._emit_content(out, self._buf[:at].rstrip())
            self._buf, self._state = self._buf[at + len(OPEN):], "head"
            return
        keep = 0 if final else len(self._buf) - len(self._buf[:len(self._buf) - _open_prefix(self._buf)].rstrip())
        self._emit_content(out, self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]

    def _head(self, out: list[tuple], final: bool) -> None:
        match = _HEAD.match(self._buf)
        if match is not None and match.end() < len(self._buf):  # the arguments' first character is here
            self.calls.append(ToolCall("call_" + uuid.uuid4().hex[:24], json.loads(f'"{match.group(1)}"')))
            out.append(("call", len(self.calls) - 1))
            self._buf, self._state = self._buf[match.end():], "args"
            self._depth, self._in_string, self._escape, self._started, self._scalar = 0, False, False, False, False
            return
        end = self._buf.find(CLOSE)
        if end < 0:
            return  # wait for more: the head, or the envelope's end
        body, rest = self._buf[:end], self._buf[end + len(CLOSE):]
        call = _whole_call(body)
        if call is None:
            self._emit_content(out, OPEN + body + CLOSE)
        else:
            self.calls.append(ToolCall("call_" + uuid.uuid4().hex[:24], call[0]))
            out.append(("call", len(self.calls) - 1))
            self._emit_args(out, call[1])
        self._buf, self._state, self._after_call = rest, "text", call is not None

    def _args(self, out: list[tuple], final: bool) -> None:
        """Release the arguments' JSON value up to its end (an object, array or string closes at
        its depth 0; a bare number or word before a comma, brace or space)."""
        if not self._started:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return
            self._started, self._scalar = True, self._buf[0] not in '{["'
        for i, ch in enumerate(self._buf):
            if self._scalar:
                if ch in ",}" or ch.isspace():
                    self._end_args(out, i)
                    return
            elif self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 0:
                        self._end_args(out, i + 1)
                        return
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end_args(out, i + 1)
                    return
        self._emit_args(out, self._buf)
        self._buf = ""

    def _end_args(self, out: list[tuple], end: int) -> None:
        self._emit_args(out, self._buf[:end])
        self._buf, self._state = self._buf[end:], "tail"

    def _tail(self, out: list[tuple], final: bool) -> None:
        end = self._buf.find(CLOSE)
        if end >= 0:  # what lies between the arguments and the envelope's end (the object's "}") is dropped
            self._buf, self._state, self._after_call = self._buf[end + len(CLOSE):], "text", True


def _open_prefix(text: str) -> int:
    """The length of the longest end of ``text`` that begins ``<tool_call>``."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def _whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of an envelope's body holding a call object, else None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
