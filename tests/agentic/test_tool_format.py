"""The tool-call format: parsing model output (well-formed, malformed, oversized) and invoking tools."""

from __future__ import annotations

import threading

import pytest

from rose.shared.agentic.tools import (
    MAX_ARGS_CHARS,
    MAX_SCAN_CHARS,
    EnvironmentFailure,
    Tool,
    ToolError,
    format_answer,
    format_call,
    invoke,
    parse,
)


def test_a_tool_call_and_an_answer_parse():
    p = parse("thinking... <tool>calc: 2 + 3</tool> and then more babble")
    assert (p.kind, p.name, p.arguments) == ("tool", "calc", "2 + 3")
    assert parse("<answer> 5 </answer>").answer == "5"
    assert parse(format_call("search", "Kavin river")).arguments == "Kavin river"
    assert parse(format_answer("17")).kind == "answer"


def test_the_first_complete_action_wins_and_arguments_may_span_lines():
    p = parse("<tool>python: def f(x):\n    return x</tool><answer>1</answer>")
    assert p.kind == "tool" and p.arguments == "def f(x):\n    return x"
    assert parse("<answer>1</answer><tool>calc: 1</tool>").kind == "answer"


@pytest.mark.parametrize(
    "text, why",
    [
        ("<tool>calc: 2+3", "not closed"),
        ("<answer>5", "not closed"),
        ("<tool>2+3</tool>", "NAME: ARGS"),
        ("<tool>9calc: 1</tool>", "NAME: ARGS"),
        ("<tool>" + "x" * 40 + ": 1</tool>", "tool name longer"),
        ("<tool>calc: " + "1" * (MAX_ARGS_CHARS + 1) + "</tool>", "arguments longer"),
    ],
)
def test_malformed_actions_say_why(text, why):
    p = parse(text)
    assert p.kind == "malformed" and why in p.error


def test_no_action_and_oversized_output():
    assert parse("just words").kind == "none"
    assert parse("").kind == "none"
    # An action beyond the scanned prefix of a huge completion is not looked for.
    assert parse("y" * MAX_SCAN_CHARS + "<answer>1</answer>").kind == "none"
    # A tag split by the scan limit is unclosed, not a crash.
    assert parse("y" * (MAX_SCAN_CHARS - 10) + "<answer>12345</answer>").kind == "malformed"


def test_invoke_separates_the_models_errors_from_broken_tools():
    def calc(args: str) -> str:
        if args == "bad":
            raise ToolError("cannot parse 'bad'")
        if args == "crash":
            raise ZeroDivisionError("inside the tool")
        if args == "huge":
            return "z" * 100
        return "ok:" + args

    tool = Tool("calc", calc, deadline_s=5.0, max_result_chars=50)
    good = invoke(tool, "1")
    assert (good.result, good.error) == ("ok:1", "") and good.duration_ms >= 0
    assert invoke(tool, "bad").error == "cannot parse 'bad'"  # shown to the model, the episode goes on
    with pytest.raises(EnvironmentFailure, match="raised ZeroDivisionError"):
        invoke(tool, "crash")
    with pytest.raises(EnvironmentFailure, match="returned 100 characters") as oversized:
        invoke(tool, "huge")
    assert oversized.value.call is not None and oversized.value.call.tool == "calc"


def test_a_tool_past_its_deadline_is_a_failure():
    release = threading.Event()
    tool = Tool("slow", lambda _: (release.wait(10), "late")[1], deadline_s=0.2)
    try:
        with pytest.raises(EnvironmentFailure, match="deadline"):
            invoke(tool, "")
    finally:
        release.set()
