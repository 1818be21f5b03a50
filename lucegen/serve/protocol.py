"""The OpenAI request and response bodies that lucegen serves: chat completions and completions.

Accepted: model, max_tokens (max_completion_tokens for chat), stop, temperature, top_p, top_k, seed, stream,
stream_options.include_usage, ignore_eos (vLLM's extension: fixed-length outputs for benchmarks), and for chat
chat_template_kwargs (enable_thinking is false unless set there). Requests for features lucegen does not have
(n > 1, logprobs, tools, ...) are rejected with a 400 naming the field; other unknown fields are ignored.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..engine.generate import Generation
from ..engine.sampling import SamplingParams
from .errors import APIError

# field -> the values that ask for nothing lucegen lacks; any other value is rejected
_UNSUPPORTED = {
    "n": (None, 1), "best_of": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "echo": (None, False), "suffix": (None, ""), "tools": (None, []), "functions": (None, []),
    "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "response_format": (None, {"type": "text"}),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    def sampling(self) -> SamplingParams:
        """OpenAI's defaults: temperature 1, top_p 1; top_k off."""
        return SamplingParams(1.0 if self.temperature is None else self.temperature,
                              1.0 if self.top_p is None else self.top_p, self.top_k or 0, self.seed)

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop == "" or isinstance(stop, list) and "" in stop:
            raise ValueError("a stop string must not be empty")
        return stop

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else self.stop or []

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, ...: handed to the chat template
    role: str
    content: str | list[TextPart]


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[int]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
            raise ValueError("one prompt per request (a string or a list of token ids), not a list of prompts")
        return prompt

    def limit(self) -> int | None:
        return self.max_tokens


def parse(raw: bytes, model: type[_Request]) -> _Request:
    """A request body, validated; APIError 400 naming the field otherwise."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    for name, fine in _UNSUPPORTED.items():
        if body.get(name) not in fine:
            raise APIError(400, f"{name}={json.dumps(body[name])} is not supported by lucegen "
                                f"(it generates one choice per request, without logprobs, tools or penalties)",
                           param=name)
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise APIError(400, f"{where}: {error['msg']}", param=str(error["loc"][0]) if error["loc"] else None) \
            from None
    if request.stream_options and not request.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    return request


class Reply:
    """The response bodies of one request: a whole completion, or the chunks of a stream."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _body(self, obj: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def completion(self, result: Generation) -> dict:
        choice = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        return self._body("chat.completion" if self.chat else "text_completion", [choice], usage=usage(result))

    def chunk(self, text: str | None, finish_reason: str | None = None, *, first: bool = False,
              include_usage: bool = False) -> dict:
        """A stream chunk carrying `text` (None: none) and/or the finish reason; the first chat chunk also
        names the role. With include_usage every chunk but the last has usage null, as OpenAI sends them."""
        if self.chat:
            delta = ({"role": "assistant"} if first else {}) | ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        return self._body("chat.completion.chunk" if self.chat else "text_completion", [choice],
                          **({"usage": None} if include_usage else {}))

    def usage_chunk(self, result: Generation) -> dict:
        return self._body("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage(result))


def usage(result: Generation) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def sse(data: dict | str) -> str:
    """One server-sent event; a dict as compact JSON."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"
