"""Static policy on generated code, checked before anything of it runs.

LLM-written kernels have fooled their judges by timing work on side streams, patching the
timer or `synchronize`, reading the caller's frames, caching by pointer, or spawning
threads (docs: LESSONS.md §B). The evaluator catches most of that by construction; this
policy stops the known tricks before the code is even imported, and tells the model in
words which line broke which rule, so a repair round can fix it.

Two levels share the rules:
- `kernel`: one slot variant. Imports limited to torch, triton, math and a few harmless
  standard modules; no streams, events, graphs, host syncs, file/network/process access.
- `engine`: a whole rendered engine. Slightly wider: CUDA graphs and the side stream
  their capture needs, `torch.load` of the weights, `os.path`/`pathlib` for the weight
  path, host syncs (the engine may synchronize in `create_engine`).

The analysis is by AST and name resolution through imports; it cannot see through
aliases built at run time, which is why `getattr` with a computed name, `setattr`,
`globals()` and friends are banned outright.
"""
from __future__ import annotations

import ast
import threading
from dataclasses import dataclass

KERNEL = "kernel"
ENGINE = "engine"
LEVELS = (KERNEL, ENGINE)

# Top-level modules a kernel may import. Everything else is refused.
KERNEL_IMPORTS = frozenset({
    "torch", "triton", "math", "__future__", "functools", "itertools", "typing",
    "dataclasses", "collections", "array", "operator", "enum", "numbers", "abc",
})
# An engine also needs to find its weight files (and read a safetensors header, which is JSON), and
# to warn on stderr (a slot that falls back to its torch variant).
ENGINE_IMPORTS = KERNEL_IMPORTS | {"os", "pathlib", "json", "warnings"}

# Builtins whose only use in a kernel is reaching outside it.
BANNED_BUILTINS = frozenset({
    "open", "exec", "eval", "compile", "__import__", "globals", "locals", "vars",
    "setattr", "delattr", "breakpoint", "exit", "quit",
    "__builtins__", "__loader__", "__spec__", "__file__",
})

# Attribute names that lead to frames, code objects or the interpreter's internals.
BANNED_ATTRIBUTES = frozenset({
    "f_globals", "f_locals", "f_back", "f_builtins", "f_code", "gi_frame", "cr_frame",
    "tb_frame", "co_code", "_getframe", "__globals__", "__builtins__", "__code__",
    "__closure__", "__subclasses__", "__dict__", "__bases__", "__mro__", "__class__",
    "__getattribute__", "__setattr__", "__delattr__", "__reduce__", "__reduce_ex__",
    "__self__", "__func__", "__wrapped__", "__import__", "__loader__", "__spec__",
    "__torch_function__", "__torch_dispatch__",
})

# Dotted names (after resolving import aliases) refused at every level. A name matches its
# entry and everything under it; a trailing `*` also matches longer names (`os.execv`).
BANNED_EVERYWHERE = {
    "os.system": "process access", "os.popen": "process access", "os.spawn*": "process access",
    "os.exec*": "process access", "os.fork*": "process access", "os.kill*": "process access",
    "os.environ": "environment access", "os.putenv": "environment access",
    "os.remove": "file access", "os.unlink": "file access", "os.rename": "file access",
    "os.replace": "file access", "os.mkdir": "file access", "os.makedirs": "file access",
    "os.rmdir": "file access", "os.open": "file access", "os.write": "file access",
    "os.chdir": "file access", "os.listdir": "file access", "os.scandir": "file access",
    "os.walk": "file access", "os._exit": "process access",
    "pathlib.Path.write*": "file access", "pathlib.Path.unlink": "file access",
    "pathlib.Path.open": "file access", "pathlib.Path.read*": "file access",
    "operator.attrgetter": "getattr by name", "operator.methodcaller": "getattr by name",
    "torch.save": "file access", "torch.hub": "network access",
    "torch.utils.cpp_extension": "native code", "torch.ops.load_library": "native code",
    "torch.multiprocessing": "process access", "torch.distributed": "process access",
    "torch.cuda.set_stream": "stream switching", "torch.cuda.set_sync_debug_mode": "timer tricks",
    "torch.cuda.cudart": "native code", "torch._C": "interpreter internals",
    "torch.compiler.disable": "interpreter internals",
    # Clocks: an engine that reads one can tell the judge's timed traces (calls back to back) from
    # its checked calls (each waits for the reference) and take another path when timed (red-team
    # helper, thirty-third session; the judge now also reports the timed runs' margin).
    "torch.utils.benchmark": "timer tricks", "torch.profiler": "timer tricks",
    "torch.autograd.profiler": "timer tricks", "triton.testing": "timer tricks",
    "torch.cuda.Event": "events (timer tricks)", "torch.cuda.streams.Event": "events (timer tricks)",
    "torch.Event": "events (timer tricks)", "os.times": "timer tricks",
    # Operator overrides: a kernel that re-registered aten's `sub` read as exact in its unit check
    # (helper-35, thirty-sixth session); pickled files load code.
    "torch.library": "operator overrides", "torch.serialization": "file access",
}

# Refused in a kernel, allowed in an engine (graph capture, weight loading, setup syncs).
BANNED_IN_KERNELS = {
    "torch.cuda.Stream": "side streams", "torch.cuda.stream": "side streams",
    "torch.cuda.current_stream": "side streams", "torch.cuda.default_stream": "side streams",
    "torch.cuda.graph": "graph capture",
    "torch.cuda.CUDAGraph": "graph capture", "torch.cuda.graph_pool_handle": "graph capture",
    "torch.cuda.make_graphed_callables": "graph capture", "torch.cuda.synchronize": "host sync",
    "torch.load": "file access", "torch.from_file": "file access", "torch.cuda.empty_cache": "allocator tricks",
    "torch.cuda.memory": "allocator tricks", "torch.cuda.caching_allocator_alloc": "allocator tricks",
}

# Standard modules that other modules re-export (`torch.os`, `F.torch.sys`): reaching one
# through an allowed module is refused at every level, whatever the import allow-list says.
REEXPORTED_MODULES = frozenset({
    "os", "sys", "subprocess", "socket", "threading", "ctypes", "inspect", "importlib", "builtins",
    "shutil", "pickle", "marshal", "multiprocessing", "io", "time", "gc", "pathlib", "tempfile",
    "urllib", "http", "asyncio", "concurrent", "weakref", "timeit", "datetime", "_thread", "resource",
    "sched", "signal",
})
# Module roots an attribute chain restarts from (`F.torch.cuda` is `torch.cuda`).
ROOT_MODULES = ("torch", "triton")
# A kernel is pasted below the engine's prelude, so these names are bound without an import.
PRELUDE_NAMES = {"torch": "torch", "F": "torch.nn.functional", "math": "math", "triton": "triton",
                 "tl": "triton.language"}

# Tensor methods that wait for the device: a kernel must not synchronize with the host.
HOST_SYNC_METHODS = frozenset({"item", "tolist", "cpu", "numpy", "synchronize"})

# Methods that touch files whatever object they are called on (`Path(...).write_text`): the
# receiver is beyond static resolution, so the method name alone is enough.
FILE_METHODS = frozenset({
    "write_text", "write_bytes", "read_text", "read_bytes", "unlink", "rmdir", "touch",
    "mkdir", "rename", "symlink_to", "chmod", "open",
})

# Attribute assignments the engine may make: backend switches, not function patches.
ASSIGNABLE_PREFIXES = ("torch.backends.",)


@dataclass(frozen=True)
class Violation:
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message} [{self.rule}]"


_PARSE_LOCK = threading.Lock()


def parse(source: str) -> ast.Module:
    """ast.parse, one thread at a time. CPython 3.11 tracks the AST conversion's recursion depth
    per interpreter, not per thread, so two threads parsing at once can fail with SystemError
    ("AST constructor recursion depth mismatch"): the agent's parallel model episodes met it."""
    with _PARSE_LOCK:
        try:
            return ast.parse(source)
        # a lone surrogate in the text; nesting past the parser's; a line the parser gives up on
        # (CPython raises MemoryError on 6000 bare words in a row: a model's prose, helper-35)
        except (ValueError, RecursionError, MemoryError) as e:
            raise SyntaxError(f"cannot be parsed ({type(e).__name__}: {str(e)[:80]})") from None


def check(source: str, level: str = KERNEL) -> list[Violation]:
    """Every rule `source` breaks at `level`, in line order. A syntax error is one violation."""
    if level not in LEVELS:
        raise ValueError(f"unknown policy level {level!r}; one of {LEVELS}")
    try:
        tree = parse(source)
    except SyntaxError as e:
        return [Violation(e.lineno or 0, "syntax", f"syntax error: {e.msg}")]
    checker = _Checker(level, _bound_names(tree))
    try:
        checker.visit(tree)
    except RecursionError:   # an expression nested past what the checker's recursion walks (x = 1+1+...)
        return [Violation(0, "syntax", "nested too deeply to be checked: write it flatter")]
    return sorted(set(checker.violations), key=lambda v: (v.line, v.rule, v.message))


def check_kernel(source: str) -> list[Violation]:
    return check(source, KERNEL)


def check_engine(source: str) -> list[Violation]:
    return check(source, ENGINE)


def describe(violations: list[Violation]) -> str:
    """The violations as the lines a model (or a log) reads."""
    return "\n".join(str(v) for v in violations)


def _matches(dotted: str, pattern: str) -> bool:
    if pattern.endswith("*"):
        return dotted.startswith(pattern[:-1])
    return dotted == pattern or dotted.startswith(pattern + ".")


def _bound_names(tree: ast.AST) -> set[str]:
    """Arguments and defs the code names itself: these shadow builtins. Plain assignments do
    not count, or `open = open` would launder the builtin."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
    return out


def _literal_getattr(node: ast.AST) -> str | None:
    """The name of a `getattr(x, "name")` call, else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return node.args[1].value
    return None


class _Checker(ast.NodeVisitor):
    def __init__(self, level: str, bound: set[str]):
        self.level = level
        self.bound = bound
        self.allowed_imports = KERNEL_IMPORTS if level == KERNEL else ENGINE_IMPORTS
        self.banned = dict(BANNED_EVERYWHERE)
        if level == KERNEL:
            self.banned.update(BANNED_IN_KERNELS)
        # local name -> dotted module path
        self.aliases: dict[str, str] = dict(PRELUDE_NAMES) if level == KERNEL else {}
        self._reported: dict[int, list[str]] = {}  # line -> dotted names already reported
        self.violations: list[Violation] = []

    def _add(self, node: ast.AST, rule: str, message: str) -> None:
        self.violations.append(Violation(getattr(node, "lineno", 0), rule, message))

    # --- imports ---------------------------------------------------------------------
    def _import_allowed(self, node: ast.AST, module: str) -> bool:
        top = module.split(".")[0]
        if top not in self.allowed_imports:
            self._add(node, "import", f"import of '{module}' is not allowed "
                      f"(allowed: {', '.join(sorted(self.allowed_imports))})")
            return False
        self._check_dotted(node, module)
        return True

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if self._import_allowed(node, alias.name):
                if alias.asname:
                    self.aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    self.aliases[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            self._add(node, "import", "relative imports are not allowed")
            return
        module = node.module or ""
        if not self._import_allowed(node, module):
            return
        for alias in node.names:
            if alias.name == "*":
                self._add(node, "import", f"'from {module} import *' is not allowed")
                continue
            full = f"{module}.{alias.name}"
            self._check_dotted(node, full)
            self.aliases[alias.asname or alias.name] = full

    # --- names and attributes ----------------------------------------------------------
    def _dotted(self, node: ast.AST) -> str | None:
        """`a.b.c` with the import alias of `a` resolved, or None when not a plain chain."""
        parts = []
        while True:
            if isinstance(node, ast.Attribute):
                parts.append(node.attr)
                node = node.value
            elif (name := _literal_getattr(node)) is not None:   # getattr(x, "name"): x.name
                parts.append(name)
                node = node.args[0]
            else:
                break
        if not isinstance(node, ast.Name) or node.id not in self.aliases:
            return None
        return ".".join([self.aliases[node.id], *reversed(parts)])

    def _check_dotted(self, node: ast.AST, dotted: str) -> None:
        line = getattr(node, "lineno", 0)
        if any(seen.startswith(dotted + ".") for seen in self._reported.get(line, [])):
            return  # the inner part of a chain already reported on this line
        parts = dotted.split(".")
        reexported = next((p for p in parts[1:] if p in REEXPORTED_MODULES), None)
        roots = [i for i, p in enumerate(parts) if p in ROOT_MODULES]
        normal = ".".join(parts[roots[-1]:]) if roots else dotted
        why = next((why for prefix, why in self.banned.items() if _matches(normal, prefix)), None)
        if reexported:
            why = f"module '{reexported}' reached through another module"
        if why:
            self._reported.setdefault(line, []).append(dotted)
            self._add(node, "banned_api", f"'{dotted}' is not allowed ({why})")

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in BANNED_BUILTINS and node.id not in self.bound and node.id not in self.aliases:
            self._add(node, "banned_builtin", f"'{node.id}' is not allowed")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in BANNED_ATTRIBUTES:
            self._add(node, "introspection", f"attribute '{node.attr}' is not allowed "
                      "(frames, code objects and class internals are off limits)")
        dotted = self._dotted(node)
        if dotted is not None:
            self._check_dotted(node, dotted)
        self.generic_visit(node)

    def _check_attribute_name(self, node: ast.AST, receiver: ast.AST, name: str) -> None:
        """`receiver.name` reached through getattr with a literal name, held to the attribute rules."""
        if name in BANNED_ATTRIBUTES:
            self._add(node, "introspection", f"attribute '{name}' is not allowed "
                      "(frames, code objects and class internals are off limits)")
        elif name in FILE_METHODS:
            self._add(node, "file_access", f"'.{name}' touches files; not allowed")
        elif name in REEXPORTED_MODULES:
            self._add(node, "banned_api", f"'{name}' is not allowed (module '{name}' reached through another object)")
        else:
            dotted = self._dotted(receiver)
            if dotted is not None:
                self._check_dotted(node, f"{dotted}.{name}")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "getattr" and "getattr" not in self.bound:
            name = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)
                    and not name.value.startswith("__")):
                self._add(node, "getattr", "getattr is allowed only with a literal, non-dunder name")
            else:   # getattr(x, "name") is x.name: the same rules (`getattr(torch, "os")` had passed)
                self._check_attribute_name(node, node.args[0], name.value)
        if isinstance(func, ast.Attribute) and func.attr in FILE_METHODS:
            self._add(node, "file_access", f"'.{func.attr}()' touches files; not allowed")
        if (self.level == KERNEL and isinstance(func, ast.Attribute)
                and func.attr in HOST_SYNC_METHODS and not node.args):
            self._add(node, "host_sync", f"'.{func.attr}()' synchronizes with the host; "
                      "a kernel must not")
        self.generic_visit(node)

    # --- assignments: no patching of modules or classes --------------------------------
    def _check_target(self, target: ast.AST) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self._check_target(t)
            return
        if isinstance(target, ast.Attribute):
            dotted = self._dotted(target)
            if dotted is not None and not any(dotted.startswith(p) for p in ASSIGNABLE_PREFIXES):
                self._add(target, "patching", f"assigning to '{dotted}' patches a module; not allowed")

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._check_target(t)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_target(node.target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._check_target(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for t in node.targets:
            self._check_target(t)
        self.generic_visit(node)

    # --- classes: no tensor subclasses (lazy outputs that compute when compared) -------
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            dotted = self._dotted(base)
            if dotted is not None and dotted.startswith("torch.") and dotted.split(".")[-1] == "Tensor":
                self._add(node, "tensor_subclass", "subclassing torch.Tensor is not allowed")
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name in BANNED_ATTRIBUTES:
                self._add(item, "introspection", f"defining '{item.name}' is not allowed")
        self.generic_visit(node)

    def visit_Global(self, node: ast.Global) -> None:
        for name in node.names:
            if name in self.aliases:
                self._add(node, "patching", f"rebinding the imported name '{name}' is not allowed")
