"""A picture of the search: workspace/search.png, rewritten after every candidate.

Every judged candidate is a point: its score (% of the physical floor, the evaluator's geometric
mean) against the run's time when its verdict came; its proposer by colour (the builtin search
or a model); accepted ones (written to engine.py) ringed; failures along the bottom, marked by
kind; a line from a parent to its child where the archive chose the parent (agent/archive.py). matplotlib is
imported only here and only when drawing: without it the run says so once and goes on.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from agent.records import DEADLINE

SEARCH_PNG = "search.png"
FAILURE_MARKERS = {"compile_error": "x", "runtime_error": "v", "wrong_result": "X", "timeout": "s", "crash": "D",
                   DEADLINE: "|"}
BUILTIN = "builtin"
FIGURE_SIZE = (9, 5)   # inches
DPI = 110


@dataclass(frozen=True)
class Point:
    """One judged candidate, as the picture shows it."""

    index: int
    seconds: float               # since the run started, when the verdict came
    score_pct: float | None      # None: it failed
    origin: str                  # "builtin", "openai:gpt-...", "replay:...", ...
    accepted: bool
    failure: str | None = None   # the error kind of a failure
    parent: int | None = None    # the index of the candidate it was derived from, when known


def _proposer(origin: str) -> str:
    return BUILTIN if origin == BUILTIN else origin


def draw(path: Path, points: list[Point], log: Callable[[str], None]) -> bool:
    """Write the picture to `path` (atomically); False, with one log line, without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"no {SEARCH_PNG}: matplotlib is not installed (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=FIGURE_SIZE)
    passed = [p for p in points if p.score_pct is not None]
    floor = min((p.score_pct for p in passed), default=0.0)
    failed_y = floor * 0.9 if passed else 0.0
    where = {p.index: (p.seconds, p.score_pct if p.score_pct is not None else failed_y) for p in points}
    for p in points:
        if p.parent in where:
            (x0, y0), (x1, y1) = where[p.parent], where[p.index]
            ax.plot([x0, x1], [y0, y1], color="0.8", linewidth=0.8, zorder=1)
    colours = {}
    for p in points:
        name = _proposer(p.origin)
        colours.setdefault(name, f"C{len(colours)}")
    for name, colour in colours.items():
        mine = [p for p in passed if _proposer(p.origin) == name]
        ax.scatter([p.seconds for p in mine], [p.score_pct for p in mine], color=colour, label=name, zorder=3, s=28)
    best = [p for p in passed if p.accepted]
    ax.scatter([p.seconds for p in best], [p.score_pct for p in best], facecolors="none", edgecolors="black",
               s=120, linewidths=1.4, label="accepted", zorder=4)
    if best:
        ax.step([p.seconds for p in best], [p.score_pct for p in best], where="post", color="black",
                linewidth=0.8, zorder=2)
    for kind, marker in FAILURE_MARKERS.items():
        mine = [p for p in points if p.score_pct is None and (p.failure or "crash") == kind]
        if mine:
            ax.scatter([p.seconds for p in mine], [failed_y] * len(mine), marker=marker,
                       color=[colours[_proposer(p.origin)] for p in mine], zorder=3,
                       label="not judged: the budget ran out" if kind == DEADLINE else f"failed: {kind}")
    ax.set_xlabel("run time (s)")
    ax.set_ylabel("score (% of the physical floor)")
    ax.set_title(f"{len(points)} candidates, {len(best)} accepted")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=DPI)
    plt.close(fig)
    tmp.replace(path)
    return True
