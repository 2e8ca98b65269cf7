"""The check behind `tests/test_architecture.py::test_how_the_model_runs_is_chosen_in_one_place`: which code runs
per forward or decode step, and which of its branches read a fact of the machine (the rule is written there)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fusedkv"
SELECTION_MODULE = "fusedkv/engine/selection.py"
PER_CALL_ROOTS = {("fusedkv/generation.py", "generate")}
FACT_CALLS = {"available", "is_available", "library", "triton_runs_on", "native_bf16", "half_dtype", "cpu_flags",
              "device_count", "get_device_capability", "is_bf16_supported", "fits", "paged_fits", "triton_decode_fits"}
DTYPES = {"float32", "float16", "bfloat16", "float64", "half", "float", "double", "int8", "uint8"}


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
