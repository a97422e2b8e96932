"""Tool calls in a chat model's output, read as it streams: what is content and what is a call.

One `ToolCallReader` per choice takes the generated text piece by piece (`feed`, then `finish` when
the generation ends) and answers `ContentDelta`s and `ToolCallDelta`s in OpenAI's streaming order; a
non-streamed answer runs the same reader over the whole text (`collect`), so both agree. Readers:

* `PlainReader`: no tools (or `tool_choice: none`): everything is content.
* `HermesReader` (`hermes`): calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, content around them. Text that may be the start of `<tool_call>` is held back until it is
  known not to be, so half a marker is never sent as content; a block is sent once it closes (or the
  generation ends). A block whose body is not such an object is content, markers included.
  Whitespace just before a call is formatting, not content.
* `Llama3JsonReader` (`llama3_json`): an output that starts (after whitespace) with `{` or
  `<|python_tag|>` is held to the end and read as `;`-separated `{"name": ..., "parameters": {...}}`
  objects (`arguments` also accepted); if any of them is not one, the whole output is content.
* `NamedReader` (`tool_choice` names a function): the output is the function's arguments, forced by
  the grammar, and is streamed as they come.
* `RequiredReader` (`tool_choice: required`): the output is a JSON array of `{"name", "parameters"}`
  objects, forced by the grammar (name first); a call starts once its name is in and its arguments
  are streamed as they come. A generation cut off inside a call's arguments leaves them cut (as a
  named function's); one cut off before a call started leaves that rest as content.

Every call gets a fresh id `call_<24 hex>`. With `parallel_tool_calls: false` a parsed output keeps
its first call only (vLLM's rule; the forced shape allows one). Pure: no torch, no I/O.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3's start of a tool call (a special token; may be decoded away)
ParserName = Literal["hermes", "llama3_json"]
PARSERS: tuple[ParserName, ...] = ("hermes", "llama3_json")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parser_for(setting: str, chat_template: object) -> ParserName:
    """The parser of `setting` (`tool_call_parser`); `auto` reads the chat template: Hermes when it
    writes `<tool_call>`, Llama 3 JSON when it writes `<|python_tag|>` or `"parameters"` objects,
    else Hermes (the demo zoo's format)."""
    if setting in PARSERS:
        return setting  # type: ignore[return-value]
    if setting != "auto":
        raise ValueError(f"tool_call_parser must be auto or one of {', '.join(PARSERS)}, got {setting!r}")
    text = chat_template if isinstance(chat_template, str) else json.dumps(chat_template, default=str)
    if HERMES_OPEN in text:
        return "hermes"
    if PYTHON_TAG in text or '"parameters"' in text:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`: its first piece has `id` and `name`, every piece some `arguments`."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def wire(self) -> dict[str, Any]:
        """The piece as an OpenAI `delta.tool_calls` entry."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


Delta = ContentDelta | ToolCallDelta


class ToolCallReader(abc.ABC):
    """Reads one choice's output; `feed` each piece of text in order, then `finish` once."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.calls = 0  # calls sent so far

    @property
    def called(self) -> bool:
        return self.calls > 0

    @abc.abstractmethod
    def feed(self, text: str) -> list[Delta]:
        """The pieces of the answer that `text` (the next piece of output) completes."""

    def finish(self) -> list[Delta]:
        return []

    def _call(self, name: str, arguments: str) -> list[Delta]:
        """A whole call as one piece (none past the first without parallel calls)."""
        if self.calls and not self.parallel:
            return []
        self.calls += 1
        return [ToolCallDelta(self.calls - 1, arguments, new_call_id(), name)]


class PlainReader(ToolCallReader):
    def feed(self, text: str) -> list[Delta]:
        return [ContentDelta(text)] if text else []


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (and may become it)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _arguments(value: object) -> str | None:
    """A call's arguments as the JSON text OpenAI sends (None: not an object or its JSON text)."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        try:
            return value if isinstance(json.loads(value), dict) else None
        except ValueError:
            return None
    return None


def _named_call(obj: object, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments) of `{"name": ..., <key>: {...}}` for the first key present, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in keys if k in obj), None)
    arguments = "{}" if key is None else _arguments(obj[key])
    return None if arguments is None else (obj["name"], arguments)


def hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments) of a `<tool_call>` block's body, else None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return _named_call(obj, ("arguments", "parameters"))


def llama3_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls of a Llama 3 JSON output (None: it is not only such calls)."""
    text = text.strip()
    text = text.removeprefix(PYTHON_TAG).strip()
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        try:
            obj, end = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        call = _named_call(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        pos = end
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
    return calls or None


class HermesReader(ToolCallReader):
    def __init__(self, parallel: bool = True):
        super().__init__(parallel)
        self._buffer = ""  # text not sent yet: a partial marker, or an open block's body
        self._in_call = False
        self._space = ""  # trailing whitespace of the content, held until more content follows

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        out: list[Delta] = []
        while True:
            if self._in_call:
                end = self._buffer.find(HERMES_CLOSE)
                if end < 0:
                    return out
                body, self._buffer = self._buffer[:end], self._buffer[end + len(HERMES_CLOSE):]
                self._in_call = False
                out += self._block(body, closed=True)
                continue
            start = self._buffer.find(HERMES_OPEN)
            if start < 0:
                keep = _held_back(self._buffer, HERMES_OPEN)
                cut = len(self._buffer) - keep
                out += self._content(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                return out
            out += self._content(self._buffer[:start])
            self._buffer = self._buffer[start + len(HERMES_OPEN):]
            self._in_call = True

    def finish(self) -> list[Delta]:
        out = self._block(self._buffer, closed=False) if self._in_call else self._content(self._buffer)
        self._buffer, self._in_call = "", False
        if self._space and not self.called:
            out.append(ContentDelta(self._space))
        self._space = ""
        return out

    def _content(self, text: str) -> list[Delta]:
        """Content, but its trailing whitespace is held: dropped if a call follows, else sent later."""
        kept = text.rstrip()
        if not kept:
            self._space += text
            return []
        out, self._space = self._space + kept, text[len(kept):]
        return [ContentDelta(out)]

    def _block(self, body: str, closed: bool) -> list[Delta]:
        call = hermes_call(body)
        if call is None:
            return self._content(HERMES_OPEN + body + (HERMES_CLOSE if closed else ""))
        self._space = ""
        return self._call(*call)


class Llama3JsonReader(ToolCallReader):
    def __init__(self, parallel: bool = True):
        super().__init__(parallel)
        self._buffer = ""
        self._state: Literal["undecided", "content", "call"] = "undecided"

    def feed(self, text: str) -> list[Delta]:
        if self._state == "content":
            return [ContentDelta(text)] if text else []
        self._buffer += text
        if self._state == "call":
            return []
        head = self._buffer.lstrip()
        if not head or PYTHON_TAG.startswith(head):
            return []
        if head.startswith(("{", PYTHON_TAG)):
            self._state = "call"
            return []
        self._state, out, self._buffer = "content", self._buffer, ""
        return [ContentDelta(out)]

    def finish(self) -> list[Delta]:
        text, self._buffer = self._buffer, ""
        calls = llama3_calls(text) if self._state == "call" else None
        if calls is None:
            return [ContentDelta(text)] if text else []
        return [piece for call in calls for piece in self._call(*call)]


class NamedReader(ToolCallReader):
    """The whole output is the arguments of function `name`, streamed as they come."""

    def __init__(self, name: str):
        super().__init__(parallel=False)
        self.name = name

    def feed(self, text: str) -> list[Delta]:
        if not self.called:
            return self._call(self.name, text) if text else []
        return [ToolCallDelta(0, text)] if text else []

    def finish(self) -> list[Delta]:
        return [] if self.called else self._call(self.name, "")


# the head of an item of a forced `required` array, up to its arguments: the grammar writes the keys in
# the schema's order, name first
_REQUIRED_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')


class RequiredReader(ToolCallReader):
    """The output is a JSON array of `{"name", "parameters"}` objects. A call starts once its item's
    name and the start of its parameters are in; its arguments are then streamed as they come (the
    whitespace before the item's closing brace left out). An item of another shape is read whole when
    it closes (content if it is not a call)."""

    def __init__(self, parallel: bool = True):
        super().__init__(parallel)
        self._text = ""
        self._scanned = 0
        self._depth = 0
        self._in_string = self._escaped = False
        self._item_start = -1
        self._args_at = -1  # the open item's arguments start here (-1: its call has not started)
        self._args_sent = 0  # its arguments before this index are sent
        self._sent = 0  # text before this index is read (as calls)

    def feed(self, text: str) -> list[Delta]:
        self._text += text
        out: list[Delta] = []
        for i in range(self._scanned, len(self._text)):
            char = self._text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
                if self._depth == 2 and char == "{":
                    self._item_start, self._args_at = i, -1
            elif char in "]}":
                if self._depth == 2 and char == "}" and self._item_start >= 0:
                    out += self._close(i)
                self._depth -= 1
        self._scanned = len(self._text)
        if self._item_start >= 0:
            out += self._stream(len(self._text))
        return out

    def _stream(self, end: int) -> list[Delta]:
        """The open item's call: its start once its head is in, then its arguments up to `end`
        (trailing whitespace held back)."""
        out: list[Delta] = []
        if self._args_at < 0:
            head = self._head()
            if head is None or (self.called and not self.parallel):
                return []
            out += self._call(head[0], "")
            self._args_at = self._args_sent = head[1]
        upto = self._args_sent + len(self._text[self._args_sent:end].rstrip())
        if upto > self._args_sent:
            out.append(ToolCallDelta(self.calls - 1, self._text[self._args_sent:upto]))
            self._args_sent = upto
        return out

    def _head(self) -> tuple[str, int] | None:
        """The open item's function name and where its arguments start (None: not in yet)."""
        head = _REQUIRED_HEAD.match(self._text, self._item_start)
        try:
            name = None if head is None else json.loads(head.group(1))
        except ValueError:
            return None
        return None if head is None or not name else (name, head.end())

    def _close(self, i: int) -> list[Delta]:
        """Item end at `i`: the rest of its streamed arguments, or the item read whole."""
        if self._args_at < 0 and self._head() is None:
            item = self._text[self._item_start:i + 1]
            try:
                call = _named_call(json.loads(item), ("parameters",))
            except ValueError:
                call = None
            out = [ContentDelta(item)] if call is None else self._call(*call)
        else:
            out = self._stream(i)
        self._sent, self._item_start, self._args_at = i + 1, -1, -1
        return out

    def finish(self) -> list[Delta]:
        if not self.called:
            return [ContentDelta(self._text)] if self._text else []
        rest = "" if self._item_start >= 0 and self._args_at >= 0 else self._text[self._sent:]
        return [ContentDelta(rest)] if rest.strip(" \t\r\n,]") else []


def reader_for(mode: str, parser: ParserName, name: str | None = None,
               parallel: bool = True) -> ToolCallReader:
    """A fresh reader for one choice. `mode`: a request's tool mode (`none`, `auto`, `required`,
    `named` with `name`); `parser`: how `auto` reads the model's own calls."""
    if mode == "named" and name is not None:
        return NamedReader(name)
    if mode == "required":
        return RequiredReader(parallel)
    if mode == "auto":
        return HermesReader(parallel) if parser == "hermes" else Llama3JsonReader(parallel)
    return PlainReader()


def collect(reader: ToolCallReader, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output read at once: (content, OpenAI `message.tool_calls`). Content is None when
    there are calls and nothing else, as OpenAI answers."""
    pieces = reader.feed(text) + reader.finish()
    content = "".join(p.text for p in pieces if isinstance(p, ContentDelta))
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        if isinstance(piece, ToolCallDelta):
            call = calls.setdefault(piece.index, {"id": piece.id, "type": "function",
                                                  "function": {"name": piece.name, "arguments": ""}})
            call["function"]["arguments"] += piece.arguments
    return (content or None) if calls else content, list(calls.values())
