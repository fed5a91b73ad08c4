"""lumenrl-quant must work with torch alone: scan every source module's imports."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import lumenrl_quant

SRC = Path(lumenrl_quant.__file__).parent


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, is_guarded) for every import; guarded = inside try/except or a function."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        for child in ast.iter_child_nodes(node):
            g = guarded or isinstance(child, (ast.Try, ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((a.name.split(".")[0], guarded) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.append((child.module.split(".")[0], guarded))
            visit(child, g)

    visit(tree, False)
    return out


def test_src_imports_only_stdlib_torch_and_optional_triton():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        for mod, guarded in _imports(path):
            if mod in sys.stdlib_module_names or mod in {"torch", "lumenrl_quant", "__future__"}:
                continue
            if mod == "triton" and guarded:
                continue
            offenders.append(f"{path.relative_to(SRC)}: {mod}{' (unguarded)' if mod == 'triton' else ''}")
    assert not offenders, offenders


def test_public_api_is_exported():
    for name in lumenrl_quant.__all__:
        assert hasattr(lumenrl_quant, name), name
    for name in ("quantize_fp8", "dequantize_fp8", "scaled_mm", "quantize_mx", "QuantizedLinear", "quantize_model",
                 "reload_quantized_weights_", "calibrate_kv_scales", "KVScales"):
        assert name in lumenrl_quant.__all__
