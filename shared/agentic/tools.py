"""The tool-call format agents use, parsed from model output, and how a tool is invoked.

The format (the policy learns it from the scripted expert traces of the trainer's warm start):

    <tool>NAME: ARGUMENTS</tool>      call tool NAME with the raw text ARGUMENTS
    <answer>TEXT</answer>             the final answer; the episode ends and is scored

After a tool call the environment appends the result as a `tool` message, in the chat format
of the default tokenizer, and the assistant speaks again:

    <|im_end|>\\n<|im_start|>tool\\n<result>TEXT</result><|im_end|>\\n<|im_start|>assistant\\n

A tool error the *model* caused (an expression that does not parse, a query that finds
nothing) is its result too: `<result>error: ...</result>`. The model sees it and can retry.

Parsing rules (a small model's output is often malformed, and can be long):
- only the first `MAX_SCAN_CHARS` characters of a completion are looked at;
- the first *complete* `<tool>...</tool>` or `<answer>...</answer>` wins; text after it is
  ignored (the model may babble on until its token limit);
- NAME is `[A-Za-z_][A-Za-z0-9_]*` (at most `MAX_NAME_CHARS`), followed by `:`; ARGUMENTS are
  stripped of surrounding whitespace and may span lines (code), at most `MAX_ARGS_CHARS`;
- an opened but unclosed tag, a bad name, missing `:`, or oversized arguments is `malformed`
  with the reason, which the environment feeds back as an error result.

Tool *failures* are different: a tool that raises something other than `ToolError`, runs past
its deadline, or returns more than `MAX_RESULT_CHARS` is broken, not the model. That raises
`EnvironmentFailure`, and the worker marks the trajectory failed with the reason.
"""

from __future__ import annotations

import concurrent.futures
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from rose.contracts.rollout import ToolCall
from rose.shared.errors import RoseError

MAX_SCAN_CHARS = 16_384
MAX_NAME_CHARS = 32
MAX_ARGS_CHARS = 4_096
MAX_RESULT_CHARS = 8_192
DEFAULT_TOOL_DEADLINE_S = 30.0

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"

_NAME_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*:(.*)$", re.DOTALL)
_TAG_RE = re.compile(r"<(tool|answer)>")

# Tool-call workers are threads: a tool call runs beside the event loop's other episodes, and a
# tool that hangs past its deadline is abandoned (its thread finishes on its own).
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="rose-tool")


class ToolError(RoseError):
    """The model's input to a tool is wrong: the message is shown to the model as the result."""


class EnvironmentFailure(RoseError, RuntimeError):
    """The environment or a tool is broken (not the model's fault): the trajectory fails with this reason.

    Not retryable: the same completion would fail the same way on another delivery.
    """

    retryable = False

    def __init__(self, reason: str, call: ToolCall | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.call = call


@dataclass(frozen=True)
class Parsed:
    kind: Literal["tool", "answer", "none", "malformed"]
    name: str = ""
    arguments: str = ""
    answer: str = ""
    error: str = ""


def parse(completion: str) -> Parsed:
    """The first action in a completion, following the rules in the module docstring."""
    text = completion[:MAX_SCAN_CHARS]
    match = _TAG_RE.search(text)
    if match is None:
        return Parsed("none", error="no <tool>NAME: ARGS</tool> and no <answer>...</answer>")
    tag = match.group(1)
    close = TOOL_CLOSE if tag == "tool" else ANSWER_CLOSE
    end = text.find(close, match.end())
    if end < 0:
        return Parsed("malformed", error=f"<{tag}> is not closed with {close}")
    body = text[match.end() : end]
    if tag == "answer":
        return Parsed("answer", answer=body.strip())
    m = _NAME_RE.match(body)
    if m is None:
        return Parsed("malformed", error="a tool call is <tool>NAME: ARGS</tool>")
    name, arguments = m.group(1), m.group(2).strip()
    if len(name) > MAX_NAME_CHARS:
        return Parsed("malformed", error=f"tool name longer than {MAX_NAME_CHARS} characters")
    if len(arguments) > MAX_ARGS_CHARS:
        return Parsed("malformed", name=name, error=f"tool arguments longer than {MAX_ARGS_CHARS} characters")
    return Parsed("tool", name=name, arguments=arguments)


def format_call(name: str, arguments: str) -> str:
    return f"{TOOL_OPEN}{name}: {arguments}{TOOL_CLOSE}"


def format_answer(answer: str) -> str:
    return f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


def format_result(text: str) -> str:
    return f"{RESULT_OPEN}{text}{RESULT_CLOSE}"


@dataclass(frozen=True)
class Tool:
    """A named function from the argument text to the result text."""

    name: str
    fn: Callable[[str], str]
    deadline_s: float = DEFAULT_TOOL_DEADLINE_S
    max_result_chars: int = MAX_RESULT_CHARS


def invoke(tool: Tool, arguments: str) -> ToolCall:
    """Run a tool: a `ToolError` becomes the call's error; anything else raises `EnvironmentFailure`."""
    call = ToolCall(tool=tool.name, arguments=arguments)
    started = time.monotonic()
    future = _POOL.submit(tool.fn, arguments)
    try:
        result = future.result(timeout=tool.deadline_s)
    except ToolError as exc:
        call.error = str(exc)[:MAX_RESULT_CHARS]
    except concurrent.futures.TimeoutError:
        future.cancel()
        call.duration_ms = (time.monotonic() - started) * 1000
        call.error = f"tool {tool.name!r} ran past its {tool.deadline_s:g}s deadline"
        raise EnvironmentFailure(call.error, call) from None
    except Exception as exc:
        call.duration_ms = (time.monotonic() - started) * 1000
        call.error = f"tool {tool.name!r} raised {type(exc).__name__}: {exc}"[:MAX_RESULT_CHARS]
        raise EnvironmentFailure(call.error, call) from exc
    else:
        if not isinstance(result, str):
            call.error = f"tool {tool.name!r} returned {type(result).__name__}, not str"
            raise EnvironmentFailure(call.error, call)
        if len(result) > tool.max_result_chars:
            call.error = f"tool {tool.name!r} returned {len(result)} characters (limit {tool.max_result_chars})"
            raise EnvironmentFailure(call.error, call)
        call.result = result
    call.duration_ms = (time.monotonic() - started) * 1000
    return call
