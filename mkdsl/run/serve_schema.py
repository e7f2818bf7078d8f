"""The request bodies `mkdsl serve` accepts (OpenAI's fields it implements), checked by pydantic:
a wrong type or a value out of range is a 400 with OpenAI's error body, naming the field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Sampled(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI's other fields (user, n=1, ...) are accepted and unused

    model: str
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)


class CompletionRequest(_Sampled):
    prompt: str | list[str]


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def model_post_init(self, _) -> None:
        if self.max_completion_tokens is not None:  # the newer name of max_tokens
            self.max_tokens = self.max_completion_tokens
