"""The package's layering, checked: plan names live in the plan module only, imports follow
cli -> commands -> library -> model -> config -> plan (import-linter contracts in pyproject.toml), and no
module imports itself through others, counting every import statement: function-local and conditional
imports too, which import-linter's layers cannot see when both sides sit in one layer."""

import ast
import subprocess
import sys
from pathlib import Path

from fusedkv.plan import CUSTOM, GQA, PLAN_CHOICES, PLAN_NAMES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fusedkv"

# String constants that equal a plan name but mean something else: the package/model type "fusedkv".
NOT_A_PLAN = {
    ("fusedkv/__init__.py", "fusedkv"),  # AutoConfig.register(model_type)
    ("fusedkv/config.py", "fusedkv"),  # model_type
    ("fusedkv/model_dirs.py", "fusedkv"),  # model_type check
    ("fusedkv/cli.py", "fusedkv"),  # the program name
    ("fusedkv/errors.py", "fusedkv"),  # the program name in messages
    ("fusedkv/serving/plugin.py", "fusedkv"),  # AutoConfig.register(model_type)
    ("fusedkv/utils.py", "fusedkv"),  # the cache directory's name
}
# The one place that reads plan names, besides plan.py: none. (User-typed shorthands are resolved by
# `fusedkv.plan.resolve_plan_choice`; the experiment YAML files are data, not code, and are not scanned.)
ALLOWED_FILES = {"fusedkv/plan.py"}


def _plan_literals(path: Path) -> list[tuple[int, str]]:
    names = {*PLAN_NAMES, *PLAN_CHOICES, CUSTOM, GQA} | {f"{p}+{GQA}" for p in PLAN_NAMES}
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]


def test_no_plan_name_outside_the_plan_module():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED_FILES:
            continue
        for line, value in _plan_literals(path):
            if (rel, value) not in NOT_A_PLAN:
                offenders.append(f"{rel}:{line}: {value!r}")
    assert not offenders, ("plan names outside fusedkv/plan.py (use the plan's constants or lists, or ask the "
                           "plan):\n" + "\n".join(offenders))


def test_the_check_finds_a_plan_literal(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('if plan == "gqa":\n    kv = heads // 2\n')
    assert _plan_literals(bad) == [(1, "gqa")]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, from every import statement in it (an AST walk, so imports
    inside functions, `if` blocks and `try` count too). `from pkg import name` is an import of `pkg.name`
    when that is a module, else of `pkg`."""
    root = package.parent

    def name_of(path: Path) -> str:
        parts = list(path.relative_to(root).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name_of(p): p for p in package.rglob("*.py")}

    def known(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                            for alias in node.names]
        graph[name] = {t for t in map(known, targets) if t is not None and t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is a set of modules that
    import one another, directly or through others."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, ("modules that import one another (function-local imports included); move what both "
                        "need below them:\n" + "\n".join(" <-> ".join(c) for c in cycles))


def test_the_cycle_check_sees_function_local_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.b import f\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g\n    return g\n")
    (pkg / "c.py").write_text("from . import a\n")  # imports the cycle, is not part of it
    graph = import_graph(pkg)
    assert graph["pkg.sub.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("def f():\n    return 1\n")
    assert import_cycles(import_graph(pkg)) == []


def test_import_layers_hold():
    """`lint-imports` with the contracts in pyproject.toml (import-linter, in the dev extra)."""
    lint = Path(sys.executable).with_name("lint-imports")
    assert lint.exists(), "import-linter is not installed: pip install -e '.[dev]'"
    r = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


# ---- one place selects how attention runs: `fusedkv.engine.selection` ----------------------------------
SELECTION_MODULE = "fusedkv/engine/selection.py"
# What choosing an attention implementation looks like: the facts and predicates it is decided from, and
# building the implementations it installs (`layer.use(None)`, back to the model's own, is no choice).
SELECTORS = {"triton_decode_fits", "triton_runs_on", "supports", "paged_supports", "LayerFacts", "Materialized",
             "Factored", "NativeOneToken", "TritonOneToken", "AbsorbedMLA"}
# Known exceptions, each with its reason.
SELECTION_EXCEPTIONS = {
    # The native step checks, once when it is built, that it covers the model (raising otherwise).
    ("fusedkv/engine/native_step.py", "supports"),
}


def _selections(path: Path) -> list[tuple[int, str]]:
    """Calls that choose an attention implementation, function-local ones included: (line, name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in SELECTORS:
            found.append((node.lineno, name))
    return found


def test_attention_implementations_are_selected_in_one_place():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == SELECTION_MODULE:
            continue
        offenders += [f"{rel}:{line}: {name}" for line, name in _selections(path)
                      if (rel, name) not in SELECTION_EXCEPTIONS]
    assert not offenders, ("attention implementations chosen outside fusedkv/engine/selection.py (decide once, "
                           "in select_runtime):\n" + "\n".join(offenders))
    assert _selections(ROOT / SELECTION_MODULE)  # the check looks at what the selection really calls


def test_the_check_finds_a_second_selection(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def forward(self, q):\n"
                   "    from fusedkv.kernels import triton_runs_on\n"
                   "    if triton_runs_on(q.device, q.dtype):\n"
                   "        self.attn.use(NativeOneToken(self.blocks))\n"
                   "    self.attn.use(None)\n")
    assert _selections(bad) == [(3, "triton_runs_on"), (4, "NativeOneToken")]
