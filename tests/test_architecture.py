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


# ---- one place chooses how the model runs: `fusedkv.engine.selection` ------------------------------------
# The rule, checked by what code does rather than by a list of names: outside the selection module, no code
# that runs per forward or per decode step branches on a fact of the machine: the device (`.device`,
# `is_cuda`, a `device` variable), a fixed dtype (`.dtype` against `torch.float32` ...), the availability of a
# kernel or backend (`native.available()`, `torch.cuda.is_available()`, `triton_runs_on`, `*_available()` ...)
# or a backend's class name (`type(x).__name__`, `__mro__`, "...Backend" / "...Impl" strings). A branch is an
# `if` / `while` / conditional expression / `and`-`or` whose test reads such a fact; an `if` whose body only
# raises is a check, not a choice. Code that runs per forward or step: every `forward` and `__call__` method in
# the package, `generate`'s loop, and every function they call that resolves statically (same module, imports,
# `self.` methods, base classes, and `x.name()` where one class of the package defines `name`), transitively.
# Choices made once outside that code (loading, layout, CLI device resolution) are not per call.
SELECTION_MODULE = "fusedkv/engine/selection.py"
PER_CALL_ROOTS = {("fusedkv/generation.py", "generate")}
FACT_CALLS = {"available", "is_available", "library", "triton_runs_on", "native_bf16", "half_dtype", "cpu_flags",
              "device_count", "get_device_capability", "is_bf16_supported", "fits", "paged_fits", "triton_decode_fits"}
DTYPES = {"float32", "float16", "bfloat16", "float64", "half", "float", "double", "int8", "uint8"}
# Known per-call branches on a fact, each with its reason (file, function).
ALLOWED_BRANCHES = {
    # A kernel's own precondition: it declines (returns None) what it cannot take and its caller then runs the
    # plain product. The caller was laid out for it by the selection (`ProductRule.native`); the decline
    # remains for autograd and dtypes a caller may pass. (issue 40: a per-call decline, not yet a decision)
    ("fusedkv/kernels/cpu_gemv.py", "linear"),
    ("fusedkv/kernels/cpu_gemv.py", "linear_blocks"),
    # The model's RMSNorm computes in f32 for 16-bit inputs (the arithmetic of the model, not a choice of
    # kernel: transformers' Llama/Qwen3 RMSNorm does the same).
    ("fusedkv/model/layers.py", "RMSNorm.forward"),
    # The native GEMV's precondition, checked on every product: it declines (0 rows) what it cannot take.
    ("fusedkv/kernels/cpu_gemv.py", "_rows"),
    # The Triton decode kernel's arithmetic per input dtype (exact f32 products; the interpreter's bf16 dot is
    # wrong, so it upcasts): how the one kernel computes, not a choice between kernels.
    ("fusedkv/kernels/triton_decode.py", "decode_step"),
    # The launch heuristic's processor count, cached per device (lru_cache: read once).
    ("fusedkv/kernels/triton_decode_blocks.py", "_num_sms"),
    # int4 GEMM weights: the f32 buffer is cast once more only for another GEMM dtype (storage, not a kernel).
    ("fusedkv/engine/precision.py", "_int4_gemm_weight"),
}


def _name(node) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _is_fact_call(name: str | None) -> bool:
    """A call that probes a fact of the machine (a kernel's or backend's availability)."""
    return name is not None and (name in FACT_CALLS or name.endswith("_available"))


def _fact_read(test: ast.AST) -> str | None:
    """The fact of the machine a branch's test reads (a short label), or None."""
    names = list(ast.walk(test))
    dtype_read = any(_name(n) is not None and _name(n).endswith("dtype") for n in names)
    for n in names:
        if isinstance(n, ast.Attribute) and n.attr in ("device", "is_cuda", "is_cpu"):
            return "device"
        if isinstance(n, ast.Name) and (n.id == "device" or n.id.endswith("_device")):
            return "device"
        if isinstance(n, ast.Attribute) and n.attr in ("__name__", "__mro__", "__class__"):
            return "class name"
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.endswith(("Backend", "Impl")):
            return "backend name"
        if isinstance(n, ast.Call) and _is_fact_call(_name(n.func)):
            return f"{_name(n.func)}()"
        if (dtype_read and isinstance(n, ast.Attribute) and n.attr in DTYPES and isinstance(n.value, ast.Name)
                and n.value.id == "torch"):
            return "dtype"
    return None


def _branches(fn: ast.AST) -> list[tuple[int, str]]:
    """(line, fact) of every branch in `fn` (nested functions and lambdas included) whose test reads a fact."""
    # One step of data flow: a local name assigned from a fact (`cpu = x.device.type == "cpu"`) is that fact.
    tainted = {}
    for node in ast.walk(fn):
        value = getattr(node, "value", None)
        decides = isinstance(value, (ast.Compare, ast.BoolOp, ast.UnaryOp)) or (
            isinstance(value, ast.Call) and _is_fact_call(_name(value.func)))
        if isinstance(node, ast.Assign) and decides and (fact := _fact_read(value)):
            tainted.update({t.id: fact for t in node.targets if isinstance(t, ast.Name)})

    def _fact_read_here(test):
        return _fact_read(test) or next((tainted[n.id] for n in ast.walk(test)
                                         if isinstance(n, ast.Name) and n.id in tainted), None)

    found, tests_seen = [], set()
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and all(isinstance(s, (ast.Raise, ast.Assert)) for s in node.body):
            tests_seen.add(id(node.test))
            continue  # a check that refuses, not a choice
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests_seen.add(id(node.test))
            fact = _fact_read_here(node.test)
        elif isinstance(node, ast.BoolOp) and id(node) not in tests_seen:  # `a and b` outside a branch's test
            fact = _fact_read_here(node)
        else:
            continue
        if fact:
            found.append((node.lineno, fact))
    return found


class _Index:
    """Every function of a package by (file, qualified name), with what each call in it resolves to."""

    def __init__(self, package: Path):
        self.root = package.parent
        self.functions: dict[tuple[str, str], ast.AST] = {}
        self.bases: dict[tuple[str, str], list[str]] = {}  # (file, class) -> base class names
        self.imports: dict[str, dict[str, tuple[str, str | None]]] = {}  # file -> local name -> (file, symbol)
        self.methods: dict[str, list[tuple[str, str]]] = {}  # method name -> [(file, qualname)]
        files = {self._module(p): p.relative_to(self.root).as_posix() for p in package.rglob("*.py")}
        for path in sorted(package.rglob("*.py")):
            rel = path.relative_to(self.root).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            self.imports[rel] = self._imports(tree, self._module(path), path.name == "__init__.py", files)
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions[(rel, node.name)] = node
                elif isinstance(node, ast.ClassDef):
                    self.bases[(rel, node.name)] = [_name(b) for b in node.bases if _name(b)]
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            self.functions[(rel, f"{node.name}.{item.name}")] = item
                            self.methods.setdefault(item.name, []).append((rel, f"{node.name}.{item.name}"))

    def _module(self, path: Path) -> str:
        parts = list(path.relative_to(self.root).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    @staticmethod
    def _imports(tree, module: str, is_package: bool, files: dict[str, str]) -> dict:
        here = module if is_package else module.rpartition(".")[0]
        out = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    local = alias.asname or alias.name
                    if f"{base}.{alias.name}" in files:
                        out[local] = (files[f"{base}.{alias.name}"], None)
                    elif base in files:
                        out[local] = (files[base], alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in files:
                        out[alias.asname or alias.name] = (files[alias.name], None)
        return out

    def _symbol(self, rel: str, name: str, seen=()) -> tuple[str, str] | None:
        """Where `name` as seen in file `rel` is defined: (file, qualname), following re-exports."""
        if (rel, name) in self.functions or (rel, name) in self.bases:
            return rel, name
        target = self.imports.get(rel, {}).get(name)
        if target and target[1] and (target[0], target[1]) not in seen:
            return self._symbol(target[0], target[1], (*seen, (rel, name)))
        return None

    def _method(self, rel: str, cls: str, name: str, seen=()) -> tuple[str, str] | None:
        """`cls.name` in file `rel`, or inherited from a base class of the package."""
        if (rel, f"{cls}.{name}") in self.functions:
            return rel, f"{cls}.{name}"
        for base in self.bases.get((rel, cls), []):
            where = self._symbol(rel, base)
            if where and where in self.bases and where not in seen:
                found = self._method(*where, name, (*seen, where))
                if found:
                    return found
        return None

    def calls(self, rel: str, qualname: str) -> set[tuple[str, str]]:
        cls = qualname.split(".")[0] if "." in qualname else None
        out = set()
        for node in ast.walk(self.functions[(rel, qualname)]):
            if not isinstance(node, ast.Call):
                continue
            func, target = node.func, None
            if isinstance(func, ast.Name):
                target = self._symbol(rel, func.id)
                if target in self.bases:  # constructing an object: its __init__ runs per call too
                    target = self._method(*target, "__init__")
            elif isinstance(func, ast.Attribute):
                owner = func.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls") and cls:
                    target = self._method(rel, cls, func.attr)
                elif isinstance(owner, ast.Call) and _name(owner.func) == "super" and cls:
                    for base in self.bases.get((rel, cls), []):
                        where = self._symbol(rel, base)
                        target = target or (where and self._method(*where, func.attr))
                elif isinstance(owner, ast.Name) and owner.id in self.imports.get(rel, {}):
                    module, symbol = self.imports[rel][owner.id]
                    target = self._symbol(module, func.attr) if symbol is None else None
                elif len(self.methods.get(func.attr, [])) == 1:  # x.name(): the one class that defines it
                    target = self.methods[func.attr][0]
            if target and target in self.functions:
                out.add(target)
        return out

    def per_call(self, selection: str) -> set[tuple[str, str]]:
        """Every function that runs per forward or step: the roots and what they call, transitively; not
        through the selection module (what it calls is part of the one decision, made before decoding)."""
        todo = [key for key in self.functions if key[1].rsplit(".", 1)[-1] in ("forward", "__call__")
                or key in PER_CALL_ROOTS]
        seen = set(todo)
        while todo:
            for callee in self.calls(*todo.pop()):
                if callee not in seen and callee[0] != selection:
                    seen.add(callee)
                    todo.append(callee)
        return seen


def per_call_choices(package: Path = PACKAGE, selection: str = SELECTION_MODULE) -> list[tuple[str, str, int, str]]:
    """(file, function, line, fact) of every branch on a fact of the machine in code that runs per call,
    outside the selection module."""
    index = _Index(package)
    found = []
    for rel, qualname in sorted(index.per_call(selection)):
        if rel != selection and not _is_fact_call(qualname.rsplit(".", 1)[-1]):  # a probe defines a fact
            branches = sorted(_branches(index.functions[(rel, qualname)]))
            found += [(rel, qualname, line, fact) for line, fact in branches]
    return found


def test_how_the_model_runs_is_chosen_in_one_place():
    found = per_call_choices()
    offenders = [f"{rel}:{line}: {qualname} branches on the {fact}" for rel, qualname, line, fact in found
                 if (rel, qualname) not in ALLOWED_BRANCHES]
    assert not offenders, ("code that runs per forward or step chooses how to run (decide once, in "
                           "fusedkv/engine/selection.py's select_runtime, and hand the model its choice through "
                           "a seam):\n" + "\n".join(offenders))
    stale = ALLOWED_BRANCHES - {(rel, qualname) for rel, qualname, _, _ in found}
    assert not stale, f"allowed branches that no longer exist (drop them from ALLOWED_BRANCHES): {sorted(stale)}"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_the_check_finds_a_planted_per_call_device_branch(tmp_path):
    """A planted second chooser: a forward that picks a kernel by the device, through a helper in another
    module; and the same branch in a function nothing calls per step is not reported."""
    pkg = _package(tmp_path, {
        "kernels.py": ("import torch\n\n"
                       "def pick(x):\n"
                       "    return fast(x) if x.device.type == 'cpu' else slow(x)\n\n"
                       "def pick_later(x):\n"
                       "    on_cpu = x.device.type == 'cpu'\n"
                       "    if on_cpu:\n"
                       "        return fast(x)\n"
                       "    return slow(x)\n\n"
                       "def load(model):\n"
                       "    if next(model.parameters()).is_cuda:\n"
                       "        model.half()\n"),
        "layer.py": ("from torch import nn\n"
                     "from . import kernels\n\n"
                     "class Layer(nn.Module):\n"
                     "    def forward(self, x):\n"
                     "        return self._run(x)\n\n"
                     "    def _run(self, x):\n"
                     "        return kernels.pick(x) + kernels.pick_later(x)\n"),
    })
    assert per_call_choices(pkg, "pkg/selection.py") == [("pkg/kernels.py", "pick", 4, "device"),
                                                          ("pkg/kernels.py", "pick_later", 8, "device")]


def test_the_check_finds_dtype_availability_and_backend_branches_and_spares_checks(tmp_path):
    pkg = _package(tmp_path, {
        "step.py": ("import torch\n"
                    "from .native import available\n\n"
                    "class Step:\n"
                    "    def __call__(self, x, impl):\n"
                    "        if x.dtype != x.new_empty(0).dtype:\n"  # two tensors' dtypes: a cast, no fact
                    "            x = x.float()\n"
                    "        if x.dtype is not torch.float32:\n"  # a check that refuses: no choice
                    "            raise ValueError('f32 only')\n"
                    "        use = available() and x.shape[0] < 16\n"
                    "        y = self.native(x) if use else x\n"
                    "        while 'FlashAttentionImpl' in type(impl).__name__:\n"
                    "            break\n"
                    "        return y if y.dtype == torch.bfloat16 else y\n"),
        "native.py": "def available():\n    return True\n",
        "selection.py": ("def choose(x):\n"
                         "    return 'cuda' if x.device.type == 'cuda' else 'cpu'\n"
                         "class Chooser:\n"
                         "    def __call__(self, x):\n"
                         "        return choose(x)\n"),
    })
    assert per_call_choices(pkg, "pkg/selection.py") == [
        ("pkg/step.py", "Step.__call__", 10, "available()"), ("pkg/step.py", "Step.__call__", 11, "available()"),
        ("pkg/step.py", "Step.__call__", 12, "backend name"), ("pkg/step.py", "Step.__call__", 14, "dtype")]
