"""Reading a decoder layer's and its MLP's forward source (ast over inspect.getsource, inherited methods too): whether
the MLP returns down_proj's output itself and whether the layer adds it to the residual untouched, which decides
what the recompute must keep (loraship.planning.shape's `ends_in_down`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap


def _method_body(cls, name: str) -> list[ast.stmt]:
    """The statements of a method (inherited ones too), or [] where the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, name))))
    except (OSError, TypeError, SyntaxError, AttributeError):
        return []
    fn = tree.body[0]
    return fn.body if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) else []


def _is_self_call(node, attr_test) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
        and attr_test(node.func.attr)
    )


def mlp_returns_down(mlp) -> bool:
    """The MLP's forward returns down_proj's output itself (a call, or a name assigned from one)."""
    body = _method_body(type(mlp), "forward")
    assigned = {}
    for stmt in body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            assigned[stmt.targets[0].id] = stmt.value
        if isinstance(stmt, ast.Return) and stmt.value is not None:
            value = stmt.value
            if isinstance(value, ast.Name):
                value = assigned.get(value.id)
            return _is_self_call(value, lambda a: a == "down_proj")
    return False


def layer_ends_in_mlp(layer) -> bool:
    """The decoder layer's forward adds the MLP's output to the residual untouched (`h = self.mlp(h)` then
    `h = residual + h`, a dropout module or a multiply by a float multiplier at most between, neither of which keeps
    it), so nothing the recompute needs reads it."""
    body = _method_body(type(layer), "forward")
    for i, stmt in enumerate(body):
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and _is_self_call(stmt.value, lambda a: a in ("mlp", "feed_forward"))
        ):
            var = stmt.targets[0].id
            after = body[i + 1] if i + 1 < len(body) else None
            if not (
                isinstance(after, ast.Assign)
                and isinstance(after.value, ast.BinOp)
                and isinstance(after.value.op, ast.Add)
            ):
                return False
            operands = (after.value.left, after.value.right)

            def plain(n):
                if isinstance(n, ast.Name):
                    return n.id == var
                if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult):  # Granite's float residual_multiplier
                    scalar = lambda x: (
                        isinstance(x, ast.Constant)
                        or (  # noqa: E731
                            isinstance(x, ast.Attribute) and x.attr.endswith("multiplier")
                        )
                    )
                    return (plain(n.left) and scalar(n.right)) or (scalar(n.left) and plain(n.right))
                return (
                    _is_self_call(n, lambda a: "dropout" in a)
                    and len(n.args) == 1
                    and isinstance(n.args[0], ast.Name)
                    and n.args[0].id == var
                )

            return any(plain(o) for o in operands) and all(isinstance(o, ast.Name) or plain(o) for o in operands)
    return False
