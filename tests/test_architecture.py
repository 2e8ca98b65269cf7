"""The package's layering, checked: plan names live in the plan module only, imports follow
cli -> commands -> library -> model -> config -> plan (import-linter contracts in pyproject.toml), and no
module imports itself through others, counting every import statement: function-local and conditional
imports too, which import-linter's layers cannot see when both sides sit in one layer."""

import ast
import subprocess
import sys
from pathlib import Path

from fusedkv.plan import CUSTOM, FUSION_MODES, GQA, PLAN_CHOICES, PLAN_NAMES
from tests._runtime_choices import per_call_choices

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


# Fusion modes are properties of `LayerKV` (`weighted`, `scalar_weighted`, `channel_weighted`, `weight_shape`):
# nothing outside the plan module compares their names. Known exceptions, each with its reason:
FUSION_MODE_EXCEPTIONS = {
    ("fusedkv/quant/kivi.py", "channel"),  # KIVI's quantisation axis (per channel), another concept
    ("fusedkv/quant/kivi_codes.py", "channel"),  # the same axis, where the arithmetic lives
    ("fusedkv/train/memory_counts.py", "reuse"),  # helper reliab's file this session (lead: `layer.weight_shape`)
}


def test_fusion_modes_are_asked_of_the_plan():
    modes = set(FUSION_MODES)
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "fusedkv/plan.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if (isinstance(node, ast.Constant) and node.value in modes
                    and (rel, node.value) not in FUSION_MODE_EXCEPTIONS):
                offenders.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not offenders, "fusion-mode names outside fusedkv/plan.py (ask the LayerKV):\n" + "\n".join(offenders)


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
# The mechanism: tests/_runtime_choices.py. On the tree before issue 40 (commit 96879d2) it reports
# attention.py's fused QK-norm+RoPE test, moe.py's grouped-GEMM test, precision.py's bf16 GEMV test, packing.py's
# layout rule and generate's layout guess and device sync.
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
    ("fusedkv/kernels/triton_paged_decode.py", "paged_decode_step"),  # the same kernel over paged blocks (serving)
    # The native paged kernel writes f32 rows: an output buffer of another dtype or layout receives a copy
    # (storage, not a choice of kernel: the serving layer's path was chosen once, `select_paths`).
    ("fusedkv/serving/paged_native.py", "native_paged_attention"),
    # The launch heuristic's processor count, cached per device (lru_cache: read once).
    ("fusedkv/kernels/triton_decode_blocks.py", "_num_sms"),
    # int4 GEMM weights: the f32 buffer is cast once more only for another GEMM dtype (storage, not a kernel).
    ("fusedkv/engine/precision.py", "_int4_gemm_weight"),
}


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
