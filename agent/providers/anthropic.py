"""Anthropic messages through the official SDK (`ANTHROPIC_BASE_URL` for a proxy).

Imported only when this provider is chosen; the SDK's own retries are off so every attempt
goes through our transcript, budget and backoff layers (agent/providers/chat.py).
"""
from __future__ import annotations

import os

from agent.providers.chat import (SERVER, TIMEOUT, UNREACHABLE, ChatError, Message, Reply,
                                  clean_text, retry_after_of, shape_error, shown_url, status_error,
                                  without_key)

DEFAULT_MODEL = "claude-sonnet-4-5"


class AnthropicChat:
    """`ChatClient` over `client.messages.create`; system messages become its `system` field."""

    provider = "anthropic"

    def __init__(self, model: str, api_key: str | None, base_url: str | None, timeout: float):
        import anthropic  # the SDK, not this module: absolute import

        self._sdk = anthropic
        self.model = model
        self.base_url = base_url
        self._key = api_key
        self.client = anthropic.Anthropic(api_key=api_key, base_url=base_url, timeout=timeout, max_retries=0)

    def complete(self, messages: list[Message], max_tokens: int) -> Reply:
        return without_key(self._complete, self._key, messages, max_tokens)

    def _complete(self, messages: list[Message], max_tokens: int) -> Reply:
        sdk = self._sdk
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
        turns = [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"]
        extra = {"system": system} if system else {}
        try:
            r = self.client.messages.create(model=self.model, max_tokens=max_tokens, messages=turns, **extra)
        except sdk.APITimeoutError as e:
            raise ChatError(TIMEOUT, str(e)) from e
        except sdk.APIConnectionError as e:
            raise ChatError(UNREACHABLE, f"{e} ({shown_url(self.base_url) or 'api.anthropic.com'})") from e
        except sdk.APIStatusError as e:
            raise status_error(e.status_code, e.message, retry_after_of(e)) from e
        except sdk.APIError as e:  # a malformed answer
            raise ChatError(SERVER, str(e)) from e
        except ValueError as e:   # a body that is not JSON, not UTF-8, or an integer past int()'s 4300 digits:
            raise ChatError(SERVER, f"the answer did not parse as JSON: {e}") from e   # the SDK lets it out
        except RecursionError as e:        # a body nested past the JSON parser's recursion
            raise ChatError(SERVER, "the answer is JSON nested too deeply to parse") from e
        try:   # the SDK builds the answer without checking its shape: content not a list, text not a string...
            return self._reply(r)
        except (AttributeError, TypeError, KeyError, IndexError) as e:
            raise shape_error(e) from e

    def _reply(self, r) -> Reply:
        text = clean_text("".join(getattr(b, "text", "") or "" for b in r.content or [] if getattr(b, "type", "") == "text"))
        usage = r.usage   # estimated where absent (budget.counted)
        return Reply(text=text, input_tokens=getattr(usage, "input_tokens", None),
                     output_tokens=getattr(usage, "output_tokens", None),
                     model=str(r.model or self.model), finish_reason=str(r.stop_reason or ""))


def create(options):
    """The LLM proposer over Anthropic (agent/providers/__init__.py calls this for `--provider anthropic`)."""
    from agent.providers.llm import build_proposer, chat_settings

    settings = chat_settings(options, model_env="ANTHROPIC_MODEL", default_model=DEFAULT_MODEL)
    if not os.environ.get("ANTHROPIC_API_KEY"):
        raise RuntimeError("ANTHROPIC_API_KEY is not set")
    base_url = os.environ.get("ANTHROPIC_BASE_URL") or None
    client = AnthropicChat(settings.model, os.environ["ANTHROPIC_API_KEY"], base_url, settings.timeout)
    return build_proposer(options, client, settings, base_url=base_url or "https://api.anthropic.com")
