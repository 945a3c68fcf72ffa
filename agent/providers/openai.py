"""OpenAI chat completions through the official SDK; any OpenAI-compatible server with
`OPENAI_BASE_URL` (a local vLLM, llama.cpp or Ollama server, a router).

The SDK is imported only here, only when this provider is chosen: the GPU machine that
runs the engines does not have it. Its own retries are off (`max_retries=0`) so that every
attempt goes through our transcript, budget and backoff layers (agent/providers/chat.py).
"""
from __future__ import annotations

import os

from agent.providers.chat import (SERVER, TIMEOUT, UNREACHABLE, ChatError, Message, Reply,
                                  clean_text, retry_after_of, shape_error, shown_url, status_error,
                                  without_key)

DEFAULT_MODEL = "gpt-5"
OFFICIAL_HOST = "api.openai.com"
# A local server needs no key, but the SDK insists on one.
PLACEHOLDER_KEY = "not-needed"


class OpenAIChat:
    """`ChatClient` over `client.chat.completions.create`."""

    provider = "openai"

    def __init__(self, model: str, api_key: str | None, base_url: str | None, timeout: float):
        import openai  # the SDK, not this module: absolute import

        self._sdk = openai
        self.model = model
        self.base_url = base_url
        self._key = api_key
        self.client = openai.OpenAI(api_key=api_key or PLACEHOLDER_KEY, base_url=base_url,
                                    timeout=timeout, max_retries=0)
        # OpenAI's own reasoning models refuse `max_tokens`; many compatible servers only know it.
        self.limit_field = "max_completion_tokens" if base_url is None or OFFICIAL_HOST in base_url else "max_tokens"

    def complete(self, messages: list[Message], max_tokens: int) -> Reply:
        return without_key(self._complete, self._key, messages, max_tokens)

    def _complete(self, messages: list[Message], max_tokens: int) -> Reply:
        sdk = self._sdk
        try:
            r = self.client.chat.completions.create(model=self.model, messages=messages,
                                                    **{self.limit_field: max_tokens})
        except sdk.APITimeoutError as e:
            raise ChatError(TIMEOUT, str(e)) from e
        except sdk.APIConnectionError as e:
            raise ChatError(UNREACHABLE, f"{e} ({shown_url(self.base_url) or OFFICIAL_HOST})") from e
        except sdk.APIStatusError as e:
            raise status_error(e.status_code, e.message, retry_after_of(e)) from e
        except sdk.APIError as e:  # a malformed answer
            raise ChatError(SERVER, str(e)) from e
        except ValueError as e:   # a body that is not JSON, not UTF-8, or an integer past int()'s 4300 digits:
            raise ChatError(SERVER, f"the answer did not parse as JSON: {e}") from e   # the SDK lets it out
        except RecursionError as e:        # a body nested past the JSON parser's recursion
            raise ChatError(SERVER, "the answer is JSON nested too deeply to parse") from e
        try:   # the SDK builds the answer without checking its shape: null message, content not a string...
            return self._reply(r)
        except (AttributeError, TypeError, KeyError, IndexError) as e:
            raise shape_error(e) from e

    def _reply(self, r) -> Reply:
        choice = r.choices[0] if r.choices else None
        text = clean_text((choice.message.content or "") if choice is not None else "")
        usage = r.usage   # absent or partial on some compatible servers: None, estimated (budget.counted)
        return Reply(text=text, input_tokens=getattr(usage, "prompt_tokens", None),
                     output_tokens=getattr(usage, "completion_tokens", None),
                     model=str(r.model or self.model), finish_reason=str(choice.finish_reason or "") if choice else "")


def create(options):
    """The LLM proposer over OpenAI (agent/providers/__init__.py calls this for `--provider openai`)."""
    from agent.providers.llm import build_proposer, chat_settings

    settings = chat_settings(options, model_env="OPENAI_MODEL", default_model=DEFAULT_MODEL)
    base_url = os.environ.get("OPENAI_BASE_URL") or None
    if not os.environ.get("OPENAI_API_KEY") and base_url is None:
        raise RuntimeError("OPENAI_API_KEY is not set (or set OPENAI_BASE_URL for a local server)")
    client = OpenAIChat(settings.model, os.environ.get("OPENAI_API_KEY"), base_url, settings.timeout)
    return build_proposer(options, client, settings, base_url=base_url or f"https://{OFFICIAL_HOST}/v1")
