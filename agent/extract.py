"""The code in a model's answer, found robustly.

Models wrap code in fences with or without a language tag, send several blocks (a helper,
a usage example, the answer), forget the closing fence when they run out of tokens, or
send bare code. The rule: among the fenced blocks, take the one that defines the most of
the functions we asked for (then prefer a python tag, then the longest); with no fence,
take the whole text if it parses as Python. A JSON block (an engine-level plan change) is
found the same way by `extract_json`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from agent.policy import parse

# An opening fence: ``` or ~~~ (3 or more), an optional info string, then the body up to
# a matching closing fence or the end of the text (a reply cut off by the token limit).
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)\n(?P<body>.*?)"
    r"(?:^[ \t]*(?P=fence)[ \t]*$|\Z)",
    re.MULTILINE | re.DOTALL,
)
PYTHON_TAGS = ("python", "py", "python3", "jinja", "j2", "")
JSON_TAGS = ("json", "")


class ExtractError(ValueError):
    """No usable block; the message is written for the model to read in a repair round."""


@dataclass(frozen=True)
class Block:
    info: str
    body: str
    closed: bool


def blocks(text: str) -> list[Block]:
    """Every fenced block in `text`, in order."""
    text = text.replace("\r\n", "\n")
    out = []
    for m in _FENCE.finditer(text):
        tag = (m.group("info").strip().split() or [""])[0].lower()
        body = m.group("body")
        closed = m.group(0).rstrip().endswith(m.group("fence"))
        indent = m.group("indent")
        if indent:
            body = "\n".join(line.removeprefix(indent) for line in body.split("\n"))
        out.append(Block(tag, body.rstrip() + "\n", closed))
    return out


def _parses(code: str) -> bool:
    try:
        parse(code)
        return True
    except SyntaxError:   # policy.parse's: a lone surrogate, nesting or a line past the parser's too
        return False


def _defined(code: str, names: tuple[str, ...]) -> int:
    r"""How many of `names` the code defines. The indent is matched within its line ([ \t]*, not
    \s*, which crosses newlines: from every line start of a run of blank lines it scanned the
    rest of the run, quadratic, and 300000 blank lines froze the agent for minutes)."""
    return sum(1 for n in names if re.search(rf"^[ \t]*def[ \t]+{re.escape(n)}[ \t]*\(", code, re.MULTILINE))


def extract_code(text: str, functions: tuple[str, ...] = ()) -> str:
    """The code block that answers the request; `functions` are names the code must define
    (they choose among several blocks). Raises ExtractError when there is no code."""
    if not text or not text.strip():
        raise ExtractError("the answer was empty; reply with one ```python code block")
    found = [b for b in blocks(text) if b.info in PYTHON_TAGS and b.body.strip()]
    if found:
        best = max(found, key=lambda b: (_defined(b.body, functions), b.info != "", b.closed,
                                        len(b.body)))
        return best.body
    stripped = text.strip() + "\n"
    if not blocks(text) and _parses(stripped) and (not functions or _defined(stripped, functions)):
        return stripped
    raise ExtractError("no ```python code block found in the answer; reply with exactly one")


def extract_json(text: str) -> dict:
    """The first JSON object in a fenced block (or the whole text). Raises ExtractError."""
    if not text or not text.strip():
        raise ExtractError("the answer was empty; reply with one ```json block")
    candidates = [b.body for b in blocks(text) if b.info in JSON_TAGS] or [text.strip()]
    errors = []
    for body in candidates:
        try:
            value = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"line {e.lineno}: {e.msg}")
            continue
        except RecursionError:
            errors.append("nested too deeply")
            continue
        if isinstance(value, dict):
            return value
        errors.append("the block is not a JSON object")
    raise ExtractError("no JSON object found in the answer" + (f" ({errors[0]})" if errors else ""))
