"""Offsets into large tensors are computed in int64 in every Triton kernel (gpu/triton_kernels/).

Triton types an index (tl.arange, tl.program_id) and a stride that fits as int32, and int32 products wrap:
a KV cache sized from most of an H200 has per-head strides near 2^31, so `head * stride` wraps for heads
>= 1 (an illegal address or silent corruption). Read from the kernels' source: in every product with a
`stride_*` argument, the other factor must be widened to int64 (`.to(tl.int64)`, directly or where the name
is assigned), or be listed in SMALL with the reason its product stays far below 2^31. Running a kernel with
such a stride would need a multi-GB tensor; this check fails on the line that goes back to int32.
"""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "gpu" / "triton_kernels"

# (file, stride, factor as written): products that cannot reach 2^31 whatever the cache's size.
SMALL = {
    ("decode.py", "stride_qh", "heads[:, None]"): "q's head stride is head_dim; heads < num_heads",
    ("decode.py", "stride_oh", "heads[:, None]"): "out's head stride is head_dim",
    ("decode.py", "stride_ko", "offs_n % PAGE"): "offset inside a block: < block_size * head_dim",
    ("decode.py", "stride_oh", "head"): "out's head stride is head_dim",
    ("prefill.py", "stride_qh", "heads[:, None]"): "q's head stride is head_dim; heads < num_heads",
    ("prefill.py", "stride_oh", "heads[:, None]"): "out's head stride is head_dim",
    ("prefill.py", "stride_ko", "offs_n % PAGE"): "offset inside a block: < block_size * head_dim",
    ("rope_cache.py", "stride_qkh", "rows[:, None]"): "qk's head stride is head_dim",
    ("rope_cache.py", "stride_vh", "kv[:, None]"): "v's head stride is head_dim",
    ("rope_cache.py", "stride_table", "position"): "loaded from int64 positions",
    ("lora.py", "stride_a_row", "offs_r[None, :]"): "inside one slot's A: rank * hidden size",
    ("lora.py", "stride_b_row", "offs_n[None, :]"): "inside one slot's B: output width * rank",
}


def _is_int64(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "int64"


def _widened(node: ast.AST, assigned: dict[str, list[ast.AST]], seen: frozenset[str] = frozenset()) -> bool:
    """Whether an expression's value is int64 by construction."""
    if isinstance(node, ast.Subscript):  # x[:, None] keeps x's type
        return _widened(node.value, assigned, seen)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to":
        return bool(node.args) and _is_int64(node.args[0])
    if isinstance(node, ast.IfExp):
        return _widened(node.body, assigned, seen) and _widened(node.orelse, assigned, seen)
    if isinstance(node, ast.BinOp):  # int32 op int64 promotes
        return _widened(node.left, assigned, seen) or _widened(node.right, assigned, seen)
    if isinstance(node, ast.Name) and node.id in assigned and node.id not in seen:
        return all(_widened(value, assigned, seen | {node.id}) for value in assigned[node.id])
    return False


def _products(path: Path) -> list[tuple[str, str, int, bool]]:
    """(stride, other factor's source, line, widened) for each product with a stride_* name in a kernel."""
    source = path.read_text()
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef):
            continue
        if not any(ast.unparse(d).startswith("triton.jit") for d in function.decorator_list):
            continue
        assigned: dict[str, list[ast.AST]] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        assigned.setdefault(target.id, []).append(node.value)
        for node in ast.walk(function):
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
                continue
            for stride, other in ((node.left, node.right), (node.right, node.left)):
                if isinstance(stride, ast.Name) and stride.id.startswith("stride_"):
                    found.append((stride.id, ast.unparse(other), node.lineno, _widened(other, assigned)))
    return found


def test_every_stride_product_in_a_triton_kernel_is_int64_or_provably_small():
    narrow, checked = [], 0
    for path in sorted(KERNELS.glob("*.py")):
        for stride, other, line, widened in _products(path):
            checked += 1
            if not widened and (path.name, stride, other) not in SMALL:
                narrow.append(f"{path.name}:{line}: {other} * {stride} is computed in int32")
    assert checked >= 20, "the kernels' stride products were not found: has the source layout changed?"
    assert narrow == [], "\n".join(narrow)


def test_the_check_sees_a_narrow_product():
    assigned = {"rows": [ast.parse("tl.where(r >= H, r - H, 0)", mode="eval").body]}
    assert not _widened(ast.parse("rows[:, None]", mode="eval").body, assigned)
    assigned["rows"].append(ast.parse("x.to(tl.int64)", mode="eval").body)
    assert not _widened(ast.parse("rows[:, None]", mode="eval").body, assigned), "every assignment counts"
    assigned["rows"] = [ast.parse("tl.program_id(0).to(tl.int64)", mode="eval").body]
    assert _widened(ast.parse("rows[:, None] + 1", mode="eval").body, assigned)
