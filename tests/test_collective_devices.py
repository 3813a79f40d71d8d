"""No collective of hftrain takes a host tensor on a group that may be NCCL's (the CPU net's static half).

A collective on a device group (``torch.distributed``'s and Accelerate's, outside ``hftrain/parallel/host.py``)
must take tensors made on the run's device: on a GPU cluster the default group and the groups built like it have
no CPU backend, and a host tensor there raises at the first step (``test_host_agreement.py`` runs the host paths
in such a group). This walks every function of ``hftrain/`` and fails on a collective whose tensor argument is, in
that function, built by a tensor constructor without ``device=`` (``torch.tensor``, ``zeros``, ``empty``...) or
moved to the host (``.cpu()``), directly or through a local name. Host facts go through ``parallel.host``.
On the code before ``parallel.host`` it names the seven call sites the GPU issue lists (checked on 7b4f349).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "hftrain"
COLLECTIVES = {
    "all_reduce", "broadcast", "all_gather", "reduce_scatter", "send", "recv", "all_to_all_single", "gather",
    "scatter", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "isend", "irecv",
}  # fmt: skip
CONSTRUCTORS = {"tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor", "zeros_like", "empty_like"}
# The one home of host-side collectives: its groups are the host twins.
ALLOWED_FILES = {"parallel/host.py"}


def _host_made(node: ast.AST, names: dict[str, list[tuple[int, ast.AST]]], line: int, depth: int = 0) -> bool:
    """Whether ``node`` (at ``line``) is, or through the local names it reads was last built as, a host tensor."""
    if depth > 4:
        return False
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
            if sub.func.attr == "cpu":
                return True
            owner = sub.func.value
            if (
                sub.func.attr in CONSTRUCTORS
                and isinstance(owner, ast.Name)
                and owner.id == "torch"
                and not any(k.arg == "device" for k in sub.keywords)
                and not sub.func.attr.endswith("_like")  # *_like keeps its model's device
            ):
                return True
        if isinstance(sub, ast.Name) and sub.id in names:
            before = [(at, value) for at, value in names[sub.id] if at < line]
            if before:
                at, value = max(before, key=lambda entry: entry[0])  # the assignment that reaches the call
                if _host_made(value, names, at, depth + 1):
                    return True
    return False


def _is_collective(call: ast.Call) -> bool:
    if not isinstance(call.func, ast.Attribute):
        return False
    owner, name = call.func.value, call.func.attr
    if isinstance(owner, ast.Name) and owner.id == "dist":
        return name in COLLECTIVES
    accelerator = (isinstance(owner, ast.Name) and owner.id == "accelerator") or (
        isinstance(owner, ast.Attribute) and owner.attr == "accelerator"
    )
    return accelerator and name == "reduce"


def _offenders(source: str, path: str) -> list[str]:
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        names: dict[str, list[tuple[int, ast.AST]]] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        names.setdefault(target.id, []).append((node.lineno, node.value))
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and _is_collective(node):
                if any(_host_made(argument, names, node.lineno) for argument in node.args):
                    found.append(f"{path}:{node.lineno} {function.name}: {ast.unparse(node)[:100]}")
    return found


def collective_offenders(root: Path = ROOT) -> list[str]:
    found = []
    for file in sorted(root.rglob("*.py")):
        relative = file.relative_to(root).as_posix()
        if relative not in ALLOWED_FILES:
            found += _offenders(file.read_text(), relative)
    return found


def test_no_collective_on_a_device_group_takes_a_host_tensor():
    assert collective_offenders() == []


def test_the_check_finds_the_patterns_it_exists_for():
    """Each way a host tensor reached an NCCL-only group before ``parallel.host`` is found (so the check can fail)."""
    cases = {
        "direct": "def f(a):\n    return a.reduce(torch.tensor([1.0]), reduction='sum')\n",
        "through a name": "def f(accelerator):\n    t = torch.tensor([1.0])\n    accelerator.reduce(t)\n",
        "zeros": "def f(g):\n    shape = torch.zeros(3, dtype=torch.int64)\n    dist.broadcast(shape, group=g)\n",
        "moved to the host": "def f(s):\n    flat = torch.cat([s.cpu()])\n    dist.all_gather([], flat)\n",
        "received on the host": "def f():\n    full = torch.empty((2,), dtype=x)\n    dist.recv(full, src=1)\n",
    }
    cases["direct"] = "def f(self):\n    self.accelerator.reduce(torch.tensor([1.0]), reduction='sum')\n"
    for name, source in cases.items():
        assert _offenders(source, name), name
    ok = "def f(g, d):\n    t = torch.zeros(3, device=d)\n    dist.all_reduce(t, group=g)\n"
    assert _offenders(ok, "ok") == []
