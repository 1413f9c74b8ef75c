"""Safe integer arithmetic for self-play: evaluate a proposed expression without ``eval``.

Promises: the text is checked before any work that could blow up (length, bracket nesting,
characters), then parsed into an AST that may hold only integer literals, ``+ - * // % **``,
unary ``+``/``-`` and brackets; the tree's depth and operator count are bounded; every value is
bounded in bits and an operation whose result would exceed the bound is refused *before* it is
computed, so ``9**9**9`` or ``10**10**10`` cost nothing. A rejection is never an exception: the
result carries a reason (recorded in the Absolute Zero decision record).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

_ALLOWED_CHARS = re.compile(r"[0-9+\-*/%() ]*")
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


class ArithLimits(BaseModel):
    """Bounds of the safe evaluator (all checked before evaluation)."""

    model_config = ConfigDict(extra="forbid")

    max_chars: int = Field(64, ge=1, description="Longest expression text accepted.")
    max_depth: int = Field(16, ge=1, description="Deepest bracket nesting and AST depth accepted.")
    max_operators: int = Field(8, ge=1, description="Most operators (binary and unary) in one expression.")
    min_operators: int = Field(1, ge=0, description="Fewest binary operators (1: a bare number is no question).")
    max_exponent: int = Field(16, ge=0, description="Largest exponent of '**'.")
    max_bits: int = Field(64, ge=8, description="Largest bit length of any intermediate or final value.")


@dataclass(frozen=True)
class ArithResult:
    """``value`` when the expression is acceptable, else ``reason`` says why it was rejected."""

    value: int | None
    reason: str | None = None
    expression: str = ""

    @property
    def ok(self) -> bool:
        return self.reason is None


class _Reject(Exception):
    pass


def evaluate_expression(text: str, limits: ArithLimits | None = None) -> ArithResult:
    """Evaluate ``text`` under ``limits``; never raises for bad input."""
    lim = limits or ArithLimits()
    if not isinstance(text, str):
        return ArithResult(None, f"expression must be text, got {type(text).__name__}")
    expr = text.strip()
    try:
        _check_text(expr, lim)
        tree = _parse(expr)
        _check_tree(tree, lim)
        value = _eval(tree.body, lim)
    except _Reject as e:
        return ArithResult(None, str(e), expr)
    return ArithResult(value, None, expr)


def _check_text(expr: str, lim: ArithLimits) -> None:
    """Cheap linear checks on the raw text: nesting first (the hostile case), then size, characters."""
    depth = deepest = 0
    for ch in expr:
        if ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise _Reject("unbalanced brackets: ')' without '('")
    if deepest > lim.max_depth:
        raise _Reject(f"brackets nested {deepest} deep (max_depth {lim.max_depth})")
    if depth:
        raise _Reject(f"unbalanced brackets: {depth} '(' not closed")
    if not expr:
        raise _Reject("empty expression")
    if len(expr) > lim.max_chars:
        raise _Reject(f"expression is {len(expr)} characters long (max_chars {lim.max_chars})")
    if not _ALLOWED_CHARS.fullmatch(expr):
        bad = next(ch for ch in expr if not _ALLOWED_CHARS.fullmatch(ch))
        raise _Reject(f"character {bad!r} is not allowed (digits, + - * // % ** and brackets only)")


def _parse(expr: str) -> ast.Expression:
    try:
        return ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        msg = getattr(e, "msg", None) or type(e).__name__
        raise _Reject(f"not an expression: {msg}") from None


def _check_tree(tree: ast.Expression, lim: ArithLimits) -> None:
    """Whitelist node types; bound depth and operator counts (iteratively: no recursion here)."""
    stack = [(tree.body, 1)]
    binary = unary = 0
    while stack:
        node, depth = stack.pop()
        if depth > lim.max_depth:
            raise _Reject(f"expression nested deeper than max_depth {lim.max_depth}")
        if isinstance(node, ast.BinOp):
            if type(node.op) not in _BINOPS:
                raise _Reject(f"operator {type(node.op).__name__} is not allowed")
            binary += 1
            stack += [(node.left, depth + 1), (node.right, depth + 1)]
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.UAdd, ast.USub)):
                raise _Reject(f"operator {type(node.op).__name__} is not allowed")
            unary += 1
            stack.append((node.operand, depth + 1))
        elif isinstance(node, ast.Constant):
            if type(node.value) is not int:
                raise _Reject(f"only integers are allowed, got {type(node.value).__name__}")
        else:
            raise _Reject(f"{type(node).__name__} is not allowed in an expression")
    if binary + unary > lim.max_operators:
        raise _Reject(f"{binary + unary} operators (max_operators {lim.max_operators})")
    if binary < lim.min_operators:
        raise _Reject(f"{binary} binary operators (min_operators {lim.min_operators})")


def _bounded(value: int, lim: ArithLimits) -> int:
    if value.bit_length() > lim.max_bits:
        raise _Reject(f"value needs {value.bit_length()} bits (max_bits {lim.max_bits})")
    return value


def _eval(node: ast.AST, lim: ArithLimits) -> int:
    """Evaluate a checked tree (depth <= max_depth, so this recursion is bounded)."""
    if isinstance(node, ast.Constant):
        return _bounded(node.value, lim)
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, lim)
        return -v if isinstance(node.op, ast.USub) else v
    a, b = _eval(node.left, lim), _eval(node.right, lim)
    op = type(node.op)
    if op is ast.Pow:
        return _power(a, b, lim)
    if op is ast.Mult and a.bit_length() + b.bit_length() > lim.max_bits + 1:
        raise _Reject(f"product needs more than max_bits {lim.max_bits} bits")
    if op in (ast.FloorDiv, ast.Mod) and b == 0:
        raise _Reject("division by zero")
    result = {
        ast.Add: lambda: a + b,
        ast.Sub: lambda: a - b,
        ast.Mult: lambda: a * b,
        ast.FloorDiv: lambda: a // b,
        ast.Mod: lambda: a % b,
    }[op]()
    return _bounded(result, lim)


def _power(base: int, exp: int, lim: ArithLimits) -> int:
    if exp < 0:
        raise _Reject(f"negative exponent {exp} (integers only)")
    if exp > lim.max_exponent:
        raise _Reject(f"exponent {exp} exceeds max_exponent {lim.max_exponent}")
    if abs(base) > 1 and (abs(base).bit_length() - 1) * exp >= lim.max_bits:
        raise _Reject(f"{base}**{exp} needs more than max_bits {lim.max_bits} bits")
    return _bounded(base**exp, lim)


_INT_REPLY = re.compile(r"-?\d+")


def parse_int_reply(text: str) -> int | None:
    """The integer a reply states, if the whole reply (stripped) is one integer; else None."""
    s = text.strip()
    if not _INT_REPLY.fullmatch(s) or len(s) > 40:
        return None
    return int(s)
