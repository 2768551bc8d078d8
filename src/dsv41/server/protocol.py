"""Request bodies of every endpoint, as pydantic models (one module, like vLLM's protocol files).

Unknown fields are ignored, as vLLM does (chat and completions keep them in `model_extra` to log them once). Numbers are parsed strictly: a bool or a string is not a number, and
NaN/inf are refused. Message contents, tools and schemas stay plain dicts here: the chat layer
(`dsv41.chat.build_chat_prompt`) validates them and names the offending field itself.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator,
                      model_validator)

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_N = 16  # choices per request (and per prompt of a completions batch)
MAX_CHOICES = 64  # prompts x n
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_TOKEN_LISTS = 4096  # stop_token_ids, allowed_token_ids
MAX_REQUEST_ID = 128

Number = StrictFloat | StrictInt
Probability = Annotated[Number, Field(ge=0.0, le=1.0)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class StreamOptions(_Request):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class SamplingFields(_Request):
    """Sampling and stopping fields common to chat and completions."""

    model: StrictStr | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    top_k: StrictInt | None = None
    min_p: Probability | None = None
    seed: Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    # logit adjustments (runtime/sampling.py adjust_logits); OpenAI's ranges for the two OpenAI penalties
    frequency_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0.0, le=10.0)] | None = None
    logit_bias: Annotated[dict[StrictStr, Annotated[Number, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=MAX_TOKEN_LISTS)] | None = None
    bad_words: Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    allowed_token_ids: Annotated[list[StrictInt], Field(min_length=1, max_length=MAX_TOKEN_LISTS)] | None = None
    include_stop_str_in_output: StrictBool = False
    # speculative drafting (docs/ENGINE.md §6): false = off, true = on, k = at most k drafts a round; the reply is
    # the same either way
    draft: StrictBool | Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    # structured output (vLLM spellings); response_format is OpenAI's
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    # vLLM's request extras (docs/SERVER.md "vLLM extras")
    return_token_ids: StrictBool = False
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    truncate_prompt_tokens: StrictInt | None = None
    priority: StrictInt = 0
    request_id: Annotated[StrictStr, Field(min_length=1, max_length=MAX_REQUEST_ID)] | None = None

    @model_validator(mode="after")
    def _common_rules(self):
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError("top_k must be -1 (off), 0 (off) or a positive integer")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if "" in self.stop_strings:
            raise ValueError("stop strings must not be empty")
        if self.bad_words is not None and "" in self.bad_words:
            raise ValueError("bad_words must not contain an empty string")
        for key in self.logit_bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
        return self

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, value):
        if value is not None and value < 1 and value != -1:
            raise ValueError("must be -1 (the context length) or a positive integer")
        return value

    @field_validator("request_id")
    @classmethod
    def _printable(cls, value):
        if value is not None and not value.isprintable():
            raise ValueError("must be printable text")
        return value

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")  # unknown fields kept in model_extra: logged once, then ignored

    messages: list[Any]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    reasoning_effort: StrictStr | StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: StrictBool = False
    add_generation_prompt: StrictBool = True  # vLLM's; false with continue_final_message: build_chat_prompt
    # thinking controls (docs/SERVER.md "Thinking controls"); build_chat_prompt reads `thinking` from the body
    thinking: dict[str, Any] | None = None
    include_reasoning: StrictBool = True
    thinking_token_budget: Annotated[StrictInt, Field(ge=0)] | None = None
    echo: StrictBool = False  # vLLM's: the reply starts with the final assistant message it continues

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.tools is not None and len(self.tools) == 0:
            raise ValueError("tools must not be an empty list")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        return self

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")

    prompt: StrictStr | list[StrictInt] | list[Any]
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = 16  # 0: only with echo (the prompt scored)
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_special_tokens: StrictBool = True
    suffix: StrictStr | None = None

    @model_validator(mode="after")
    def _completion_rules(self):
        prompts = self.prompts
        if not prompts or len(prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"prompt must hold 1 to {MAX_CHOICES // self.n} prompts (with n={self.n})")
        for p in prompts:
            if isinstance(p, str):
                if p == "":
                    raise ValueError("a prompt must not be empty")
            elif not isinstance(p, list) or not p or not all(type(t) is int for t in p):
                raise ValueError("prompt must be a string, a list of token ids, or a list of either (not empty)")
        if len({isinstance(p, str) for p in prompts}) > 1:
            raise ValueError("a list of prompts holds strings or token id lists, not both")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is only allowed with echo (the prompt scored, nothing generated)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


    @property
    def prompts(self) -> list:
        """The prompts: one string or id list, or each of a list of them."""
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and all(type(t) is int for t in p)):
            return [p]
        return list(p) if isinstance(p, list) else []


class TokenizeRequest(_Request):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Any] | None = None
    add_special_tokens: StrictBool = True
    # chat fields that change the rendering (same meaning as in a chat request)
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    reasoning_effort: StrictStr | StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    continue_final_message: StrictBool = False
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False  # vLLM's: token_strs is each token's vocabulary string

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: list[StrictInt]

