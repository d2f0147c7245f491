"""Every point-to-point transfer in polytrain goes through collectives.exchange: one
batch_isend_irecv per call. An unbatched isend/irecv/send/recv elsewhere could pair a send
and a receive with one peer apart, which the GPU collective library can hang on (its
matching ignores tags and follows posting order), so this test keeps them from coming back."""

from __future__ import annotations

import ast
from pathlib import Path

import polytrain

P2P = {"isend", "irecv", "send", "recv"}
HELPER = ("distributed/collectives.py", "exchange")  # the one place allowed to name them


def _is_torch_distributed(node: ast.expr, aliases: set[str]) -> bool:
    """`dist`, `torch.distributed` or `c10d`-like aliases bound to torch.distributed."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    return isinstance(node, ast.Attribute) and node.attr in ("distributed", "distributed_c10d") \
        and _is_torch_distributed(node.value, aliases | {"torch"})


def p2p_uses(source: str) -> list[tuple[int, str, str]]:
    """(line, enclosing function, what) for each unbatched point-to-point use in `source`."""
    tree = ast.parse(source)
    aliases = {"dist", "c10d"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name.startswith("torch.distributed") and a.asname}
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Attribute) and node.attr in P2P and _is_torch_distributed(node.value, aliases):
            found.append((node.lineno, function, ast.unparse(node)))
        if isinstance(node, ast.Attribute) and node.attr in ("isend", "irecv"):  # any module's
            found.append((node.lineno, function, ast.unparse(node)))
        if isinstance(node, ast.ImportFrom) and node.module and \
                (node.module.startswith("torch.distributed") or node.module.endswith("collectives")):
            found.extend((node.lineno, function, f"from {node.module} import {a.name}")
                         for a in node.names if a.name in P2P)
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "")
    return sorted(set(found))


def test_no_unbatched_point_to_point_outside_the_exchange_helper():
    root = Path(polytrain.__file__).parent
    offenders = [f"{path.relative_to(root.parent)}:{line} in {function or 'module'}: {what}"
                 for path in sorted(root.rglob("*.py"))
                 for line, function, what in p2p_uses(path.read_text())
                 if (path.relative_to(root).as_posix(), function) != HELPER]
    assert not offenders, ("unbatched point-to-point outside collectives.exchange (post it through exchange, "
                           "one batch per step):\n" + "\n".join(offenders))


def test_the_check_sees_each_spelling():
    """The scan itself can fail: every spelling of an unbatched transfer is found."""
    source = """
import torch.distributed as dist
import torch.distributed as tdist
import torch
from torch.distributed import recv
from polytrain.distributed.collectives import isend

def ring(x):
    dist.isend(x, 1)
    tdist.irecv(x, 0)
    torch.distributed.send(x, 1)
    recv(x, 0)
    group.irecv([x], 0, 0)
"""
    assert [what for _, _, what in p2p_uses(source)] == [
        "from torch.distributed import recv", "from polytrain.distributed.collectives import isend",
        "dist.isend", "tdist.irecv", "torch.distributed.send", "group.irecv"]
    assert p2p_uses("import socket\ndef f(s, q):\n    s.send(b'x'); q.recv()\n") == []
