"""Shared fixtures: tiny configs of every plan, with fusion weights randomised so that tests do not
lean on the tidy initial values; and the test tiers (pyproject.toml's markers): tests marked `manual` are
skipped unless `--run-manual` or FUSEDKV_RUN_MANUAL=1 asks for them, whatever `-m` says."""

import os

# One thread unless OMP_NUM_THREADS says otherwise, here and in the child processes the tests start: the tests
# run tiny shapes, where a second OpenMP thread only adds hand-offs, and on a 2-core machine shared with other
# jobs threads that spin waiting for a descheduled partner made the fast tier about twice as slow (user CPU
# and wall). The tests of the multi-threaded kernels set their thread counts themselves.
ONE_THREAD = "OMP_NUM_THREADS" not in os.environ
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import fusedkv  # noqa: E402, F401  (registers the Auto classes)
from fusedkv import FusedKVConfig, FusedKVForCausalLM  # noqa: E402

if ONE_THREAD:
    torch.set_num_threads(1)  # in case torch was imported before this file

PLAN_CONFIGS = {
    "vanilla": dict(kv_sharing="vanilla"),
    "gqa": dict(kv_sharing="gqa"),
    "cla": dict(kv_sharing="cla"),
    "yoco": dict(kv_sharing="yoco"),
    "fusedkv-lite": dict(kv_sharing="fusedkv-lite"),
    "fusedkv": dict(kv_sharing="fusedkv"),
    "fusedkv-dense": dict(kv_sharing="fusedkv-dense"),
    "fusedkv-iterative": dict(kv_sharing="fusedkv", fusion_init="iterative"),
    "fusedkv-gqa": dict(kv_sharing="fusedkv", num_key_value_heads=2),
    "reversed": dict(kv_sharing="custom", kv_source_map=[{"layers": [3, 4], "k": 1, "v": 2}]),
    "single-source-scaling": dict(kv_sharing="custom", kv_source_map=[
        {"layers": [3, 4], "k": 2, "v": 1, "k_fusion": "channel", "v_fusion": "channel"}]),
}


def pytest_addoption(parser):
    parser.addoption("--run-manual", action="store_true",
                     help="also run the tests marked manual (long runs outside CI; also FUSEDKV_RUN_MANUAL=1)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-manual") or os.environ.get("FUSEDKV_RUN_MANUAL") == "1":
        return
    skip = pytest.mark.skip(reason="manual: a long run outside CI; run it with --run-manual")
    for item in items:
        if "manual" in item.keywords:
            item.add_marker(skip)


# Test modules with no case in the fast tier, each for a process-level cost that is the point of the test: a
# compiler build, Triton's interpreter, vLLM engines, torchrun, the per-family uptrain script. Every other
# module keeps at least one fast case (tests/test_tiers.py checks it on every fast-tier run).
SLOW_ONLY = {
    "tests/kernels/test_native_avx2.py", "tests/kernels/test_triton_kernel.py",
    "tests/serving/test_gpu_backend_path.py", "tests/serving/test_paged_layout.py",
    "tests/serving/test_tensor_parallel.py", "tests/serving/test_vllm_families.py",
    "tests/serving/test_vllm_moe_mla.py", "tests/serving/test_vllm_plans.py",
    "tests/train/test_dcp_resume.py", "tests/train/test_distributed.py", "tests/train/test_multinode.py",
    "tests/uptrain/test_families_script.py",
}
TIERS = pytest.StashKey[dict]()  # {"deselected": modules with a deselected case, "kept": modules with a selected one}


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_deselected(items):
    if items:
        items[0].config.stash.setdefault(TIERS, {"deselected": set(), "kept": set()})["deselected"].update(
            map(_module, items))


def pytest_collection_finish(session):
    session.config.stash.setdefault(TIERS, {"deselected": set(), "kept": set()})["kept"] = set(
        map(_module, session.items))


@pytest.fixture
def tier_modules(request) -> dict | None:
    """What this run's selection did to the test modules (TIERS), or None where it deselected nothing."""
    return request.config.stash.get(TIERS, None)


def tiered(cases, fast, name=lambda *case: "-".join(map(str, case))) -> list:
    """The parameter tuples `cases` as pytest.params (ids: `name(*case)`, by default pytest's own "a-b-3"), those
    for which `fast(*case)` is false marked slow: they run in the full suite, not in the fast tier."""
    return [pytest.param(*case, id=name(*case), marks=() if fast(*case) else pytest.mark.slow) for case in cases]


def tiny_config(**overrides) -> FusedKVConfig:
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                head_dim=16, max_position_embeddings=128, pad_token_id=0)
    base.update(overrides)
    return FusedKVConfig(**base)


def randomize_fusion(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "fusion" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.7 + 0.3)


def tiny_model(plan: str = "fusedkv", seed: int = 0, dtype=torch.float32, **overrides) -> FusedKVForCausalLM:
    torch.manual_seed(seed)
    cfg = tiny_config(**{**PLAN_CONFIGS.get(plan, dict(kv_sharing=plan)), **overrides})
    model = FusedKVForCausalLM(cfg).to(dtype).eval()
    if cfg.fusion_init != "iterative":
        randomize_fusion(model, seed)
    return model


@pytest.fixture(params=list(PLAN_CONFIGS))
def plan_name(request):
    return request.param


@pytest.fixture
def torch_kernels(monkeypatch):
    """Decode with PyTorch's kernels only: the native CPU kernel switched off as a user would
    (FUSEDKV_NATIVE_KERNELS=0), and switched back on afterwards."""
    from fusedkv.kernels import native

    monkeypatch.setenv("FUSEDKV_NATIVE_KERNELS", "0")
    native.redecide()
    yield
    monkeypatch.undo()
    native.redecide()


@pytest.fixture(params=["native", "torch"])
def decode_kernels(request):
    """Run a test once with the native CPU decode kernels (skipped where they are not built) and once with
    PyTorch's alone."""
    from fusedkv.kernels import native

    if request.param == "torch":
        request.getfixturevalue("torch_kernels")
    elif not native.available():
        pytest.skip("no C compiler: the native CPU kernels are not built")
    return request.param
