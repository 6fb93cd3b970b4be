"""A pure, bounded arithmetic evaluator for the `calc` tool: + - * / // % ( ) and integers only.

Never uses eval(). Bounds: expression length, integer size and nesting depth, so hostile input costs
microseconds and yields a CalcError with a reason instead of hanging or raising anything else.
"""
from __future__ import annotations

import ast

MAX_EXPR_CHARS = 200
MAX_ABS_VALUE = 10**30
MAX_DEPTH = 32


class CalcError(ValueError):
    pass


def _eval(node: ast.AST, depth: int) -> int:
    if depth > MAX_DEPTH:
        raise CalcError("expression nested too deeply")
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _eval(node.operand, depth + 1)
        value = -inner if isinstance(node.op, ast.USub) else inner
    elif isinstance(node, ast.BinOp):
        a, b = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        op = node.op
        if isinstance(op, ast.Add):
            value = a + b
        elif isinstance(op, ast.Sub):
            value = a - b
        elif isinstance(op, ast.Mult):
            value = a * b
        elif isinstance(op, (ast.FloorDiv, ast.Div, ast.Mod)):
            if b == 0:
                raise CalcError("division by zero")
            value = a % b if isinstance(op, ast.Mod) else a // b
        else:
            raise CalcError(f"operator {type(op).__name__} not allowed")
    else:
        raise CalcError(f"{type(node).__name__} not allowed")
    if abs(value) > MAX_ABS_VALUE:
        raise CalcError("value out of range")
    return value


def calculate(expr: str) -> int:
    """Evaluate `expr`; raises CalcError (only) on anything that is not bounded integer arithmetic."""
    if not isinstance(expr, str):
        raise CalcError("expression must be text")
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} chars")
    if not expr.strip():
        raise CalcError("empty expression")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError) as exc:
        raise CalcError(f"syntax error: {exc.msg if isinstance(exc, SyntaxError) else exc}") from None
    return _eval(tree.body, 0)
