"""The house's shape (docs/architecture.md, "Layers"): layers, no cycles, small modules.

``.importlinter`` holds the layer contracts; ``make test`` runs ``lint-imports``
before the suite, and this test runs the same contracts so ``pytest`` alone checks
them too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "kernels", "distill", "edge_agent", "cloud_service", "simulations")
MAX_MODULE_LINES = 600


def _modules(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def test_layer_contracts_hold() -> None:
    lint = pytest.importorskip("importlinter.cli")
    assert lint.lint_imports(config_filename=str(ROOT / ".importlinter"), no_cache=True) == 0


@pytest.mark.parametrize("package", (*PACKAGES, "scripts"))
def test_no_module_over_the_size_limit(package: str) -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for path in _modules(package)
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: split them along their seams"


@pytest.mark.parametrize("folder", (*PACKAGES, "scripts", "bench"))
def test_product_code_never_imports_the_tests(folder: str) -> None:
    offenders = []
    for path in _modules(folder):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            offenders += [
                f"{path.relative_to(ROOT)}:{node.lineno}"
                for name in names
                if name == "tests" or name.startswith("tests.")
            ]
    assert offenders == []
