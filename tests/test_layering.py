"""The import arrows point one way (docs/design.md §1), read from the source with `ast`, every
import counted (inside functions and under TYPE_CHECKING too, and importlib calls with a
literal name):

    evaluator/                          imports nothing of the agent (it owns the truth)
    agent/records.py, plan.py, spec.py  the bottom of the agent (checkpoint.py: spec's reader of
                                        Hugging Face folders): nothing above them
    agent/providers/, agent/search.py   the proposers: not the loop, the cli, the judge
    agent/loop.py, cli.py, ...          on top
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BOTTOM = ("agent.records", "agent.plan", "agent.spec", "agent.checkpoint")
ABOVE_PROPOSERS = ("agent.loop", "agent.cli", "agent.judge", "agent.report", "agent.resume", "agent.render",
                   "agent.__main__")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module (or module.name) `path` imports, by absolute name."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            prefix = node.module or ""
            if node.level:   # relative: resolved against the file's package
                package = module_name(path).split(".")[:-1] if path.name != "__init__.py" else \
                    module_name(path).split(".")
                prefix = ".".join(package[:len(package) - node.level + 1] + ([prefix] if prefix else []))
            out.add(prefix)
            out.update(f"{prefix}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) in (
                    "import_module", "__import__"):
                out.add(node.args[0].value)
    return out


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("line", ["import agent", "import agent.plan as p", "from agent.plan import Plan",
                                  "from agent import loop", "if TYPE_CHECKING:\n    from agent.spec import ModelSpec",
                                  "def f():\n    from agent.cli import main",
                                  "def f():\n    importlib.import_module('agent.cli')",
                                  "__import__('agent')"])
def test_the_parser_sees_every_form_of_import(tmp_path, line):
    probe = tmp_path / "probe.py"
    probe.write_text(f"import importlib\n{line}\n")
    assert any(within(n, ("agent",)) for n in imported(probe))


@pytest.mark.parametrize("path", files("evaluator"), ids=lambda p: p.name)
def test_no_module_of_the_evaluator_imports_the_agent(path):
    bad = sorted(n for n in imported(path) if within(n, ("agent",)))
    assert not bad, f"{path.relative_to(REPO)} imports {bad}"


@pytest.mark.parametrize("name", BOTTOM)
def test_the_bottom_of_the_agent_imports_nothing_above_it(name):
    path = REPO / (name.replace(".", "/") + ".py")
    bad = sorted(n for n in imported(path) if within(n, ("agent",)) and n != "agent" and not within(n, BOTTOM))
    assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("path", files("agent/providers") + [REPO / "agent" / "search.py"],
                         ids=lambda p: p.name)
def test_no_proposer_imports_the_loop_the_cli_or_the_judge(path):
    bad = sorted(n for n in imported(path) if within(n, ABOVE_PROPOSERS))
    assert not bad, f"{path.relative_to(REPO)} imports {bad}"
