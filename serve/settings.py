"""The server's settings (no torch here: the CLI checks its flags and inputs before loading it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ServeSettings:
    max_batch: int = 64
    max_queue: int = 1024            # waiting requests before 503
    max_prefill_tokens: int = 8192   # prompt tokens admitted in one step (at least one prompt)
    max_body_bytes: int = 8 << 20    # request bodies above: 413
    retry_after_s: int = 1           # the Retry-After of a 503
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)   # defaults, e.g. enable_thinking
