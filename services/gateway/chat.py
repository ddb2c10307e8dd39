"""The policy's chat format at the gateway: an agent's messages become prompt token ids, the tokens the
policy sampled become an assistant message (text and tool calls), and a later turn's prompt extends the
tokens already sampled instead of re-encoding them.

Token in, token out (the rollout worker's rule, for a conversation an agent keeps): the first turn's
prompt is the policy's chat template applied to the agent's messages. A later turn's prompt is the
previous turn's prompt ids + its generated ids (never decoded and encoded again) + the tokens of what
the template appends after them: the rest of the assistant's end-of-message (nothing but "\\n" when the
policy ended its message itself, all of it when it ran out of tokens), then whatever the template
renders for the messages the agent added (tool results, a user turn) and the next assistant header,
taken as `render(conversation now) - render(the previous turn's conversation and its answer)`.

That holds while the agent's messages are the previous turn's messages, the answer it got (compared
as the template sees them: role, text, tool names and arguments; ids are free), then new ones, with the
same tools. Otherwise (`continuation` returns a `Break`) the turn starts a new segment, its prompt
encoded from the messages, and the trajectory says why.

Tool calls are parsed in the policy's own format, chosen once from its chat template: ROSE's models
(shared/models.py) write `<tool>NAME: ARGS</tool>` (shared/agentic/tools.py), Qwen2-style templates
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A call the request's tools cannot take (a
tool not offered, arguments that are not an object of the tool's parameters, broken JSON) comes back
as text, never as an error.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from rose.shared.agentic import tools as rose_tools
from rose.shared.openai_api import ApiError, unicode_text

ROLES = ("system", "user", "assistant", "tool")
ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
TOOL_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
HERMES_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PROBE = "\u2063rose-probe\u2063"  # text no conversation contains: where a message's content sits in the template's rendering
END_OF_MESSAGE_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>")  # ChatML (Qwen), Llama 3, Phi: a turn ends at these or EOS
ToolChoice = Literal["auto", "none"]
Message = dict[str, Any]


# ---- requests --------------------------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts (the other part kinds are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return unicode_text(content, where)
    if isinstance(content, list):
        pieces = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text") or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}[{i}]: only text parts ({{'type': 'text', 'text': ...}}) are supported by the policy", param="messages")
            pieces.append(unicode_text(part["text"], f"{where}[{i}].text"))
        return "".join(pieces)
    raise ApiError(400, f"{where} must be a string, null or a list of text parts", param="messages")


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            raise ApiError(400, f"{where}.function.arguments is not JSON: {raw[:80]!r}", param="messages") from None
        if isinstance(value, dict):
            return value
    raise ApiError(400, f"{where}.function.arguments must be a JSON object", param="messages")


def normalize_messages(raw: Any) -> list[Message]:
    """The agent's messages as the template takes them (and as turns are compared): role, text content,
    tool calls with their arguments as objects, a tool result's call id."""
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "`messages` must be a non-empty list of {role, content}", param="messages")
    out: list[Message] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object with a role and content", param="messages")
        role = m.get("role")
        role = ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)} (or developer), got {m.get('role')!r}", param="messages")
        message: Message = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
        calls = m.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise ApiError(400, f"{where}.tool_calls: only an assistant message has tool calls, as a list", param="messages")
            normalized = []
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise ApiError(400, f"{where}.tool_calls[{j}] must have a function with a name", param="messages")
                normalized.append(
                    {
                        "id": str(call.get("id") or ""),
                        "type": "function",
                        "function": {"name": function["name"], "arguments": _arguments(function.get("arguments"), f"{where}.tool_calls[{j}]")},
                    }
                )
            message["tool_calls"] = normalized
        if role == "tool" and m.get("tool_call_id") is not None:
            message["tool_call_id"] = str(m["tool_call_id"])
        out.append(message)
    return out


def normalize_tools(raw: Any) -> list[dict[str, Any]]:
    """`tools` as the template takes them: functions with a safe name, a description and a parameters schema."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ApiError(400, "`tools` must be a list of {type: function, function: {name, parameters}}", param="tools")
    out = []
    for i, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ApiError(400, f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
            raise ApiError(400, f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}", param="tools")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON Schema object", param="tools")
        entry = {"name": name, "description": str(function.get("description") or ""), "parameters": parameters}
        out.append({"type": "function", "function": entry})
    return out


def tool_choice(raw: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """ "auto" (the default) or "none"; a forced call ("required", a named function) needs guided decoding,
    which rollout does not do: 400 naming the parameter, never a silently unforced answer."""
    if raw is None or raw == "auto":
        return "auto"
    if raw == "none":
        return "none"
    raise ApiError(
        400,
        f"`tool_choice` {raw!r} is not supported: the gateway cannot force a call (rollout samples the policy freely); send 'auto' or 'none'",
        param="tool_choice",
    )


def message_key(m: Message) -> tuple:
    """What the template renders of a message, for comparing the agent's history with the turns answered."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True)) for c in m.get("tool_calls") or ())
    return (m["role"], m.get("content") or "", calls)


def digest(*parts: Any) -> str:
    """SHA-256 of canonical JSON (a request's identity, for answering a retry from its checkpoint)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()


def conversation_digest(messages: list[Message], tools: list[dict[str, Any]]) -> str:
    return digest("chat", [list(message_key(m)) for m in messages], tools)


# ---- answers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedReply:
    """What the policy said: its text (outside any tool call) and its tool calls, each {name, arguments}."""

    content: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: str = ""  # why a call in the text was returned as text


def _call_of(name: str, arguments: dict[str, Any], tools: list[dict[str, Any]]) -> dict[str, Any] | str:
    offered = {t["function"]["name"]: t["function"] for t in tools}
    if name not in offered:
        return f"calls {name!r}, which the request does not offer ({', '.join(sorted(offered)) or 'no tools'})"
    return {"name": name, "arguments": arguments}


def _rose_arguments(raw: str, tool: dict[str, Any] | None) -> dict[str, Any] | None:
    """ROSE's `<tool>NAME: ARGS</tool>` carries raw text: the argument of a tool with one parameter, else a JSON object."""
    properties = ((tool or {}).get("parameters") or {}).get("properties") or {}
    if len(properties) == 1:
        return {next(iter(properties)): raw}
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


class RoseCalls:
    """`<tool>NAME: ARGS</tool>`, the format of the models shared/models.py builds; one call per turn."""

    name = "rose"

    def parse(self, text: str, tools: list[dict[str, Any]]) -> ParsedReply:
        action = rose_tools.parse(text)
        if action.kind != "tool":
            return ParsedReply(text, malformed=action.error if action.kind == "malformed" else "")
        offered = {t["function"]["name"]: t["function"] for t in tools}
        arguments = _rose_arguments(action.arguments, offered.get(action.name))
        if arguments is None:
            return ParsedReply(text, malformed=f"arguments of {action.name!r} are neither its one parameter nor a JSON object")
        call = _call_of(action.name, arguments, tools)
        if isinstance(call, str):
            return ParsedReply(text, malformed=call)
        before = text[: text.find(rose_tools.TOOL_OPEN)].strip()
        return ParsedReply(before, [call])


class HermesCalls:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen2-style templates ask for; any number."""

    name = "hermes"

    def parse(self, text: str, tools: list[dict[str, Any]]) -> ParsedReply:
        blocks = HERMES_CALL_RE.findall(text)
        if not blocks:
            return ParsedReply(text, malformed="<tool_call> is not closed" if "<tool_call>" in text else "")
        calls = []
        for block in blocks:
            try:
                value = json.loads(block)
            except (json.JSONDecodeError, RecursionError):
                return ParsedReply(text, malformed=f"a <tool_call> is not JSON: {block[:80]!r}")
            arguments = value.get("arguments", {}) if isinstance(value, dict) else None
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except (json.JSONDecodeError, RecursionError):
                    arguments = None
            if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(arguments, dict):
                return ParsedReply(text, malformed="a <tool_call> needs a name and an arguments object")
            call = _call_of(value["name"], arguments, tools)
            if isinstance(call, str):
                return ParsedReply(text, malformed=call)
            calls.append(call)
        return ParsedReply(HERMES_CALL_RE.sub("", text).strip(), calls)


class NoCalls:
    """A template with no tool-call format: text only."""

    name = "none"

    def parse(self, text: str, tools: list[dict[str, Any]]) -> ParsedReply:
        return ParsedReply(text)


# ---- the format ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Break:
    """The agent's request does not extend a turn's tokens: a new segment starts, for this reason."""

    reason: str


class ChatFormat:
    """The policy tokenizer's chat template, its tool-call format and its stop tokens (chosen once at start)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        if not template:
            raise ValueError("the policy's tokenizer has no chat template: the gateway renders agents' messages with it")
        self.renders_tools = "tools" in template
        self.calls: RoseCalls | HermesCalls | NoCalls = (
            HermesCalls() if "<tool_call>" in template else RoseCalls() if rose_tools.TOOL_OPEN in template else NoCalls()
        )
        vocab = tokenizer.get_vocab()
        self.vocab_size = len(tokenizer)  # a prompt's token ids are below this (special tokens included)
        ends = [vocab[t] for t in END_OF_MESSAGE_TOKENS if t in vocab]
        self.stop_token_ids = sorted({t for t in (*ends, tokenizer.eos_token_id) if isinstance(t, int) and t >= 0})
        self.end_of_message = self._end_of_message()

    # ---- rendering ----

    def render(self, messages: list[Message], tools: list[dict[str, Any]], *, generation: bool = True) -> str:
        if tools and not self.renders_tools:
            raise ApiError(400, "the policy's chat template does not render tools: send none, or give the policy a template that does", param="tools")
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation, tokenize=False)
        except Exception as exc:  # a template's own checks (roles out of order, a missing field): the agent's to fix
            raise ApiError(400, f"the policy's chat template cannot render these messages: {type(exc).__name__}: {exc}", param="messages") from None
        return str(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], *, special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not special)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _end_of_message(self) -> str:
        """What the template writes after an assistant message's content (ChatML: "<|im_end|>\\n")."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": PROBE}]
        text = self.render(probe, [], generation=False)
        return text[text.index(PROBE) + len(PROBE) :] if PROBE in text else ""

    def prompt_ids(self, messages: list[Message], tools: list[dict[str, Any]]) -> list[int]:
        """A segment's first prompt: the whole conversation, encoded."""
        return self.encode(self.render(messages, tools))

    def closing(self, token_ids: list[int], finish_reason: str) -> str:
        """The end-of-message text the template has after these generated tokens: its remainder after the stop
        token that ended them, or all of it when the policy ran out of tokens."""
        if finish_reason == "stop" and token_ids:
            last = self.decode(token_ids[-1:], special=True)
            if last and self.end_of_message.startswith(last):
                return self.end_of_message[len(last) :]
        return self.end_of_message

    def continuation(
        self, before: list[Message], answered: Message, tools_before: list[dict[str, Any]], messages: list[Message], tools: list[dict[str, Any]]
    ) -> list[Message] | Break:
        """The messages this request adds after a turn whose request was `before` and whose answer `answered`;
        a `Break` (with the reason) when it does not extend that turn."""
        if tools != tools_before:
            return Break("the tools offered changed since the previous turn (the prompt renders them)")
        held = [*before, answered]
        if len(messages) < len(held):
            return Break(
                f"the conversation has {len(messages)} messages, fewer than the {len(held)} of the previous turn and its answer "
                "(history dropped or summarised)"
            )
        for i, (old, new) in enumerate(zip(held, messages)):
            if message_key(old) != message_key(new):
                if i == len(before):
                    return Break(f"messages[{i}] is not the answer the gateway gave (the agent edited the assistant's message)")
                return Break(f"messages[{i}] ({new['role']}) differs from what the agent sent before (it edited its history)")
        return messages[len(held) :]

    def appended_ids(
        self, before: list[Message], answered: Message, generated: list[int], finish_reason: str, messages: list[Message], tools: list[dict[str, Any]]
    ) -> tuple[list[int], str] | Break:
        """The token ids (and their text) that follow a turn's prompt + generated tokens for this request."""
        held = self.render([*before, answered], tools, generation=False)
        now = self.render(messages, tools)
        if not now.startswith(held):
            return Break("the chat template renders the earlier conversation differently once more messages follow")
        text = self.closing(generated, finish_reason) + now[len(held) :]
        return self.encode(text), text

    def reply(self, token_ids: list[int], tools: list[dict[str, Any]], choice: ToolChoice) -> ParsedReply:
        text = self.decode(token_ids)
        if not tools or choice == "none":
            return ParsedReply(text)
        return self.calls.parse(text, tools)
