"""The layering of ARCHITECTURE.md holds: import-linter's contracts (pyproject.toml) pass on the
tree, and each fails when a module breaks it (a contract that cannot fail is not a contract);
servers reach engines only through `engine.protocol` and `engine.builder`."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "pallas_kernels", "sharding", "serving")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_keeps_every_contract() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packages' sources and pyproject.toml, where a test may add a module."""
    root = tmp_path_factory.mktemp("tree")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("_generated"))
    (root / "tests").mkdir()
    (root / "tests" / "__init__.py").touch()
    shutil.copy(ROOT / "tests" / "lint_contracts.py", root / "tests")
    shutil.copy(ROOT / "pyproject.toml", root)
    return root


# (where a new module goes, what it imports, the contract it breaks)
BREAKS = [
    ("pallas_kernels/probe.py", "import engine.request", "Kernels know no model"),
    ("engine/models/probe.py", "import engine.scheduler", "Models know no host state"),
    ("sharding/probe.py", "import serving.cli", "The engine and sharding know no server"),
    ("serving/probe.py", "import engine.llm_engine", "Servers see engines only through"),
    ("engine/probe.py", "import engine.llm_engine", None),  # allowed: breaks nothing
]


@pytest.mark.parametrize(("path", "line", "broken"), BREAKS)
def test_a_forbidden_import_breaks_its_contract(
    tree_copy: Path, path: str, line: str, broken: str | None
) -> None:
    probe = tree_copy / path
    probe.write_text(f"{line}\n")
    try:
        done = lint_imports(tree_copy)
    finally:
        probe.unlink()
    if broken is None:
        assert done.returncode == 0, done.stdout
    else:
        assert done.returncode != 0
        assert re.search(rf"{re.escape(broken)}.* BROKEN", done.stdout), done.stdout


def test_jax_in_the_scheduler_breaks_its_contract(tree_copy: Path) -> None:
    scheduler = tree_copy / "engine" / "scheduler.py"
    original = scheduler.read_text()
    scheduler.write_text("import jax.numpy\n" + original)
    try:
        done = lint_imports(tree_copy)
    finally:
        scheduler.write_text(original)
    assert re.search(r"The scheduler, the allocator and requests know no JAX BROKEN", done.stdout)


def test_an_import_cycle_breaks_its_contract(tree_copy: Path) -> None:
    errors = tree_copy / "engine" / "errors.py"
    original = errors.read_text()
    errors.write_text(original + "\nfrom engine import request  # noqa\n")  # request -> errors
    try:
        done = lint_imports(tree_copy)
    finally:
        errors.write_text(original)
    assert "No import cycles between modules BROKEN" in done.stdout
    assert "engine.errors -> engine.request -> engine.errors" in done.stdout


# What a server may not do with an engine: probe it, or reach into its parts.
REACHING_IN = re.compile(
    r"hasattr\(|getattr\(args|\.runner\b|(?<!config)\.scheduler\b|\.kv_cache\b|\.replicas\b"
    r"|engine\._\w"
)


def test_serving_reaches_engines_only_through_the_protocol() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {text.strip()}"
        for path in sorted((ROOT / "serving").rglob("*.py"))
        if "_generated" not in path.parts
        for number, text in enumerate(path.read_text().splitlines(), 1)
        if REACHING_IN.search(text) or ("Namespace" in text and path.name != "cli.py")
    ]
    assert not offenders, "\n".join(offenders)


def test_engines_are_built_only_by_the_builder() -> None:
    """LLM, `xlaserve generate` and `serve` (HTTP and gRPC), and the benchmarks construct no
    engine of their own: `build_engine` is the one seam."""
    constructing = re.compile(r"\b(LLMEngine|DataParallelEngine|ModelRunner)\(")
    allowed = {
        ROOT / "engine" / "builder.py",
        ROOT / "engine" / "llm_engine.py",
        # The device benchmark times the step on Llama-3-8B-shaped random weights made on the
        # device, per layer or stacked for lax.scan: parameters no checkpoint loader produces.
        ROOT / "bench" / "gpu" / "llama_bench.py",
        # A speculative engine's draft model runs in a runner of its own, inside the engine
        # that build_engine builds.
        ROOT / "engine" / "speculative" / "draft.py",
    }
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for directory in ("engine", "serving", "sharding", "bench")
        for path in sorted((ROOT / directory).rglob("*.py"))
        if path not in allowed
        for number, text in enumerate(path.read_text().splitlines(), 1)
        if constructing.search(text)
    ]
    assert not offenders, offenders
