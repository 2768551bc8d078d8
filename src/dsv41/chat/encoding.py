"""The DeepSeek-V4.1 prompt encoder, reproducing DeepSeek's released `encoding/encoding.py` byte for byte.

Written from ENCODING.md and the golden cases in `shared/fixtures/encoding/`; the rules below are the
reference's behaviour, quirks included (nothing is escaped, effort is validated in chat mode too, tools anywhere
switch drop_thinking off, unknown roles before the last user turn vanish in thinking mode).

A conversation is a list of OpenAI-style dicts. Roles: system, user, assistant, tool, latest_reminder.
Turn structure: user, tool and mid-conversation system messages are "user turns"; the generation header
`<｜Assistant｜>` + think token belongs to the user turn, never to the assistant message that follows.

`encode_pieces` returns the same text split into template and content pieces (chat/pieces.py): what the
request supplied (message content, reasoning, tool schemas, call names and arguments) is content, so the
tokenizer keeps a control token spelled there as plain text.
"""

from .errors import EncodingError
from .pieces import Pieces
from .tokens import (ASSISTANT, BOS, EOS, IMAGE, LATEST_REMINDER, SYSTEM, TASK_TOKENS, THINK_END, THINK_START,
                     USER, USER_TASKS, ASSISTANT_TASKS)
from .tools_text import render_calls, system_text

THINKING_MODES = ("chat", "thinking")
EFFORT_ALIASES = {"low": 50, "high": 75, "max": 100}
DEFAULT_EFFORT = "high"
KNOWN_ROLES = ("system", "user", "assistant", "tool", "latest_reminder")
IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil")
TURN_JOINER = "\n\n"


def effort_line(effort: int) -> str:
    return f"Reasoning Effort: {effort} (range 1-100, the higher the value, the more thorough the reasoning)"


def resolve_effort(reasoning_effort) -> int:
    """The reference's strict effort check: 'low'/'high'/'max' or an int (not bool) in 1..100."""
    if reasoning_effort is None:
        reasoning_effort = DEFAULT_EFFORT
    if isinstance(reasoning_effort, str) and reasoning_effort in EFFORT_ALIASES:
        return EFFORT_ALIASES[reasoning_effort]
    if type(reasoning_effort) is int and 1 <= reasoning_effort <= 100:
        return reasoning_effort
    raise EncodingError(
        f"Invalid reasoning effort for deepseek_v41: {reasoning_effort}, "
        f"should be int within [1,100] or {list(EFFORT_ALIASES)}"
    )


def encode_messages(messages, thinking_mode, context=None, drop_thinking=True, add_default_bos_token=True,
                    reasoning_effort=None) -> str:
    """Render `messages` (after the already-rendered `context`) as V4.1 prompt text.

    thinking_mode: "chat" or "thinking". context: earlier messages whose text was already sent; only `messages`
    are rendered and no BOS is added. reasoning_effort: None (75), 'low'/'high'/'max' or an int 1..100.
    Raises EncodingError where the reference raises (or crashes).
    """
    return encode_pieces(messages, thinking_mode, context, drop_thinking, add_default_bos_token,
                         reasoning_effort).text


def encode_pieces(messages, thinking_mode, context=None, drop_thinking=True, add_default_bos_token=True,
                  reasoning_effort=None, add_generation_prompt=True) -> Pieces:
    """`encode_messages` as template and content pieces (their text joined is `encode_messages`'s result).

    add_generation_prompt=False (not in the reference, which always writes it; vLLM's request field): a final
    user / tool / mid-system turn ends without its generation header `<｜Assistant｜>` + think token."""
    if thinking_mode not in THINKING_MODES:
        raise EncodingError(f"thinking_mode must be 'chat' or 'thinking', got {thinking_mode!r}")
    effort = resolve_effort(reasoning_effort)
    if not isinstance(messages, list) or (context is not None and not isinstance(context, list)):
        raise EncodingError("messages and context must be lists of message objects")
    context = context or []
    conversation = [*context, *messages]
    for index, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise EncodingError(f"message {index} must be an object, got {type(message).__name__}")
    thinking = thinking_mode == "thinking"
    # Any non-empty tools list anywhere (even on a message that does not render it) keeps all reasoning.
    drop = thinking and drop_thinking and not any(m.get("tools") for m in conversation)
    first_new = len(context)
    if drop:
        conversation, first_new = _drop_unknown_roles(conversation, first_new)
    conversation = _sort_tool_results(conversation)
    return _Renderer(conversation, thinking, drop, effort, add_generation_prompt).render(
        first_new, with_bos=add_default_bos_token and not context)


def _is_user_turn(conversation: list, index: int) -> bool:
    role = conversation[index].get("role")
    return role in ("user", "tool") or (role == "system" and index > 0)


def _last_user_index(conversation: list) -> int:
    return max((i for i in range(len(conversation)) if _is_user_turn(conversation, i)), default=-1)


def _drop_unknown_roles(conversation: list, first_new: int) -> tuple[list, int]:
    """drop_thinking's side effect: messages of roles it does not know vanish before the last user turn."""
    last_user = _last_user_index(conversation)
    kept, kept_before_new = [], 0
    for index, message in enumerate(conversation):
        if message.get("role") not in KNOWN_ROLES and index < last_user:
            continue
        kept.append(message)
        kept_before_new += index < first_new
    return kept, kept_before_new


def _sort_tool_results(conversation: list) -> list:
    """Reorder each run of tool messages to the call order of the latest assistant with tool calls.

    An id that is not among the calls sorts as the first call; the sort is stable, so results without ids keep
    their arrival order.
    """
    result, call_order, index = [], {}, 0
    while index < len(conversation):
        message = conversation[index]
        if message.get("role") == "assistant" and message.get("tool_calls"):
            call_order = {}
            for position, call in enumerate(message["tool_calls"]):
                if isinstance(call, dict) and call.get("id") is not None:
                    call_order.setdefault(call["id"], position)
        if message.get("role") != "tool":
            result.append(message)
            index += 1
            continue
        end = index
        while end < len(conversation) and conversation[end].get("role") == "tool":
            end += 1
        run = conversation[index:end]
        result.extend(sorted(run, key=lambda m: call_order.get(m.get("tool_call_id"), 0)))
        index = end
    return result


def _text_parts(content, *, role: str, index: int, keep_unknown: bool) -> Pieces:
    """Content as text: a string as is; list parts joined by a blank line, images as the placeholder."""
    if isinstance(content, str):
        return Pieces().c(content)
    if not isinstance(content, list):
        raise EncodingError(f"message {index} ({role}): content must be a string or a list of parts")
    out, first = Pieces(), True
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            piece = Pieces().c(part.get("text") or "")
        elif kind in IMAGE_PART_TYPES:
            piece = Pieces().t(IMAGE)
        elif keep_unknown:
            piece = Pieces().c(f"[Unsupported {kind}]")
        else:
            continue
        out.t("" if first else TURN_JOINER).add(piece)
        first = False
    return out


class _Renderer:
    """Walks a prepared conversation and renders each message with its neighbours in view."""

    def __init__(self, conversation: list, thinking: bool, drop: bool, effort: int, generation_prompt: bool = True):
        self.conversation = conversation
        self.generation_prompt = generation_prompt
        self.thinking = thinking
        self.drop = drop
        self.effort = effort
        self.last_user = _last_user_index(conversation)

    def render(self, first_new: int, with_bos: bool) -> Pieces:
        out = Pieces().t(BOS if with_bos else "")
        for index in range(first_new, len(self.conversation)):
            out.add(self._message(index))
        return out

    # -- neighbours -------------------------------------------------------------------------------------------
    def _role(self, index: int) -> str | None:
        if 0 <= index < len(self.conversation):
            return self.conversation[index].get("role")
        return None

    def _joins_previous_turn(self, index: int) -> bool:
        """Users and tool results continue the previous user/tool message unless that one carried a task."""
        if index == 0:
            return False
        previous = self.conversation[index - 1]
        return previous.get("role") == "tool" or (previous.get("role") == "user" and not previous.get("task"))

    def _turn_ends_with_header(self, index: int) -> bool:
        following = self._role(index + 1)
        if following is None:
            return self.generation_prompt
        return following in ("assistant", "latest_reminder")

    def _header(self, index: int) -> str:
        opens_thinking = self.thinking and (not self.drop or index == self.last_user)
        return ASSISTANT + (THINK_START if opens_thinking else THINK_END)

    # -- messages -----------------------------------------------------------------------------------------------
    def _message(self, index: int) -> Pieces:
        message = self.conversation[index]
        role = message.get("role")
        if index == 0 and self.thinking:
            prefix = Pieces().t(SYSTEM + effort_line(self.effort) + "\n\n")
        elif index == 0 and role == "system":
            prefix = Pieces().t(SYSTEM)
        else:
            prefix = Pieces()
        if role == "system":
            return prefix.add(self._system(index, message))
        if role == "user":
            return prefix.add(self._user(index, message))
        if role == "tool":
            return prefix.add(self._tool(index, message))
        if role == "assistant":
            return prefix.add(self._assistant(index, message))
        if role == "latest_reminder":
            return prefix.t(LATEST_REMINDER).add(self._plain_content(index, message))
        raise EncodingError(f"message {index}: unsupported role {role!r} (V4.1 knows {', '.join(KNOWN_ROLES)})")

    def _plain_content(self, index: int, message: dict) -> Pieces:
        content = message.get("content")
        if content is None:
            return Pieces()
        return _text_parts(content, role=message.get("role"), index=index, keep_unknown=False)

    def _system(self, index: int, message: dict) -> Pieces:
        text = system_text(self._plain_content(index, message), message.get("tools"),
                           message.get("response_format"))
        if index == 0:
            return text  # the caller already wrote <｜System｜> (and the effort line)
        out = Pieces().t(SYSTEM).add(text)
        if self._turn_ends_with_header(index):
            out.t(self._header(index))
        return out

    def _user(self, index: int, message: dict) -> Pieces:
        content = message.get("content")
        if content is None:
            raise EncodingError(f"message {index} (user): content must not be null")
        text = _text_parts(content, role="user", index=index, keep_unknown=True)
        typed_text = [content] if isinstance(content, str) else [
            p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if any(IMAGE in t for t in typed_text):
            # Images are placed only through image parts; a typed placeholder would desync them.
            raise EncodingError(f"message {index} (user): the image placeholder {IMAGE} may not appear in text")
        out = Pieces().t(TURN_JOINER if self._joins_previous_turn(index) else USER).add(text)
        task = message.get("task")
        if task:
            if task not in USER_TASKS:
                raise EncodingError(f"message {index} (user): unknown task {task!r}, expected one of {USER_TASKS}")
            if task == "action":
                return out.t(self._header(index) + TASK_TOKENS[task])
            return out.t(TASK_TOKENS[task])
        if self._turn_ends_with_header(index):
            out.t(self._header(index))
        return out

    def _tool(self, index: int, message: dict) -> Pieces:
        result = self._plain_content(index, message)
        out = Pieces().t(TURN_JOINER if self._joins_previous_turn(index) else USER)
        out.t("<tool_result>").add(result).t("</tool_result>")
        if self._turn_ends_with_header(index):
            out.t(self._header(index))
        return out

    def _assistant(self, index: int, message: dict) -> Pieces:
        previous = self.conversation[index - 1] if index > 0 else {}
        after_task = bool(previous.get("task"))
        keeps_reasoning = self.thinking and not after_task and (not self.drop or index > self.last_user)
        out = Pieces()
        if keeps_reasoning:
            out.c(message.get("reasoning_content") or "").t(THINK_END)
        out.add(self._plain_content(index, message))
        if message.get("tool_calls"):
            out.add(render_calls(message["tool_calls"]))
        if not message.get("wo_eos"):
            out.t(EOS)
        task = message.get("task")
        if task:
            if task not in ASSISTANT_TASKS:
                raise EncodingError(f"message {index} (assistant): unknown task {task!r}, expected 'title'")
            out.t(TASK_TOKENS[task])
        return out
