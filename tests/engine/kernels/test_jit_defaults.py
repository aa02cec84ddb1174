"""No Triton jit function gives a constexpr parameter a string default.

Triton 3.6 (the H200's) fails to compile a call of a jit helper that leaves such a parameter at
its default ("'str' object has no attribute 'type'"); newer Triton accepts it, so neither the
interpreter nor the compile check here would notice. The MoE prefill GEMM hit it through
w4a16_dot.wleft_steps's eviction switch, which is now a bool."""

from __future__ import annotations

import ast
from pathlib import Path

import homelab_llm

ROOT = Path(homelab_llm.__file__).resolve().parent


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit" or (
        isinstance(target, ast.Name) and target.id == "jit")


def string_constexpr_defaults(source: str) -> list[str]:
    """'function(parameter)' for every jit function's constexpr parameter with a str default."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef) or not any(map(_is_jit, node.decorator_list)):
            continue
        args = node.args.posonlyargs + node.args.args
        pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults))
        pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
        for arg, default in pairs:
            constexpr = arg.annotation is not None and "constexpr" in ast.unparse(arg.annotation)
            if constexpr and isinstance(default, ast.Constant) and isinstance(default.value, str):
                found.append(f"{node.name}({arg.arg})")
    return found


def test_the_check_finds_a_string_default():
    source = ('import triton\nimport triton.language as tl\n@triton.jit\n'
              'def helper(x, A: tl.constexpr = False, B: tl.constexpr = ""):\n    pass\n')
    assert string_constexpr_defaults(source) == ["helper(B)"]


def test_no_jit_function_has_a_string_constexpr_default():
    found = {str(path.relative_to(ROOT)): hits for path in sorted(ROOT.rglob("*.py"))
             if (hits := string_constexpr_defaults(path.read_text()))}
    assert found == {}
