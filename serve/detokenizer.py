"""Generated token ids → text increments that are always valid UTF-8, cut at stop strings.

A token may end in the middle of a character (a byte-level model emits one byte per token; a
BPE token may hold half of an emoji). Decoding the new ids alone would emit U+FFFD, so the
decoder keeps a window of recent ids and emits only once the window's text no longer ends in
an incomplete sequence (the scheme vLLM and TGI use). A window, not each token alone, because
some decoders (sentencepiece's leading spaces) read a token differently at the start of a text.

Stop strings may straddle tokens: the text that could still be the start of a stop string is
held back until it is known not to be one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from serve.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5   # ids of the prompt's end that seed the window (leading-space context)


@dataclass
class Detokenizer:
    """One request's output text. `push(token)` → the new text safe to send (maybe "");
    `finish()` → whatever was held back. `stopped` turns True once a stop string appeared; the
    text then ends just before it and nothing more is emitted."""

    tokenizer: Tokenizer
    prompt_ids: list[int]
    stops: list[str] = field(default_factory=list)
    text: str = ""               # everything decoded so far (cut at a stop string, once found)
    sent: int = 0                # characters of `text` handed out
    stopped: bool = False

    def __post_init__(self) -> None:
        self.ids = list(self.prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix = 0                 # window start in self.ids
        self.read = len(self.ids)       # ids up to here are already in self.text
        self.hold = max((len(s) for s in self.stops), default=1) - 1   # chars that may start a stop

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""    # an incomplete character (or a token that decodes to nothing): wait
        self._append(after[len(before):])
        self.prefix, self.read = self.read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest: held-back text, and an incomplete character's U+FFFD, at the end of output."""
        if not self.stopped:
            before = self.tokenizer.decode(self.ids[self.prefix:self.read])
            after = self.tokenizer.decode(self.ids[self.prefix:])
            self._append(after[len(before):])
        return self._release(final=True)

    def _append(self, delta: str) -> None:
        start = max(len(self.text) - self.hold, 0)   # a stop string may begin in earlier text
        self.text += delta
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.text = self.text[:min(found)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final or self.stopped else max(len(self.text) - self.hold, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out
