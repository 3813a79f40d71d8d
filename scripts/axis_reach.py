"""Which files under ``hftrain/`` name a parallel axis in code, outside the places an axis is allowed to live.

Issue 38's measure of how far one axis reaches: a file counts for an axis when one of its code tokens names it: an
identifier ``cp``, ``cp_size``, ``dp_cp_group``, ``.cp`` (any identifier with ``cp`` as one of its ``_``-separated
words), or a string literal that is the axis's name (``"cp"``) or a config key of it (``"parallelism.cp"``,
``"cp_comm"``). Comments and docstrings do not count. Allowed: the axis's own modules only (:data:`OWN`); the
axis declarations (``parallel/axes.py``, ``parallel/dims.py``), ``parallel/parallelize.py``, the family registry and
the config schema count like any other file (issue 56: the cost of an axis lives there too).

A family's own module (``parallel/families/<family>.py``) or a task's (``tasks/<task>.py``) that names the axis is
listed apart, as a *declaration*: that family or task saying it cannot take the axis (``refusals={"cp": why}``,
``megatron_axes_not_built``), as issue 56 asks a family module to hold its refusals. A new axis edits none of them;
a family that cannot take it says so in its own file. The *shared* files are the cost of an axis (issue 56's goal:
at most 4, ``tests/test_axis_reach.py``).

    python scripts/axis_reach.py            # cp and ep
    python scripts/axis_reach.py tp pp -v   # any axes, with the lines
    python scripts/axis_reach.py --rev 367dc3c  # as at another revision
"""

from __future__ import annotations

import argparse
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OWN = {  # each axis's own modules (its kernels and wiring), relative to hftrain/
    "cp": (
        "parallel/context_parallel.py",
        "parallel/cp_kernels.py",
        "parallel/cp_attention.py",
        "parallel/cp_scored.py",
        "parallel/cp_relative.py",
        "plan/context_parallel.py",
    ),
    "ep": ("parallel/expert_parallel.py", "parallel/ep_routing.py", "plan/expert_parallel.py"),
    "tp": ("parallel/tensor_parallel.py", "parallel/tp_replicas.py"),
    "pp": ("parallel/pipeline.py",),
}


def names_axis(token: tokenize.TokenInfo, axis: str) -> bool:
    """Whether a code token names ``axis``."""
    if token.type == tokenize.NAME:
        return axis in token.string.split("_")
    if token.type == tokenize.STRING:
        value = token.string.strip("rbfuRBFU").strip("\"'")
        return re.fullmatch(rf"(strategy\.|parallelism\.)?{axis}(_\w+)?", value) is not None
    return False


def is_docstring(tokens: list[tokenize.TokenInfo], i: int) -> bool:
    """Whether token ``i`` is a string statement of its own (a docstring): the first significant token of a logical
    line. A string that starts a continuation line inside brackets (an argument) is code."""
    if tokens[i].type != tokenize.STRING:
        return False
    j = i - 1
    while j >= 0 and tokens[j].type in (tokenize.NL, tokenize.COMMENT):
        j -= 1
    return j < 0 or tokens[j].type in (tokenize.INDENT, tokenize.NEWLINE, tokenize.DEDENT, tokenize.ENCODING)


def is_declaration(rel: str) -> bool:
    """Whether ``rel`` (relative to ``hftrain/``) is one family's or one task's own module (not a registry or a
    record)."""
    parts = rel.split("/")
    if parts[:2] == ["parallel", "families"] and len(parts) == 3:
        return parts[2] not in ("__init__.py", "family.py")
    return parts[0] == "tasks" and len(parts) == 2 and parts[1] not in ("__init__.py", "record.py")


def shared(found: dict[str, list[int]]) -> dict[str, list[int]]:
    """The files of :func:`reach` that are not a family's or a task's own declarations: the cost of the axis."""
    return {rel: lines for rel, lines in found.items() if not is_declaration(rel)}


def reach(axis: str, root: Path = ROOT) -> dict[str, list[int]]:
    """File (relative to ``hftrain/``) -> lines naming ``axis`` in code, outside the allowed files."""
    found: dict[str, list[int]] = {}
    for path in sorted((root / "hftrain").rglob("*.py")):
        rel = path.relative_to(root / "hftrain").as_posix()
        if rel in OWN.get(axis, ()):
            continue
        tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
        lines = []
        for i, token in enumerate(tokens):
            if not names_axis(token, axis) or is_docstring(tokens, i):
                continue
            lines.append(token.start[0])
        if lines:
            found[rel] = sorted(set(lines))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("axes", nargs="*", default=["cp", "ep"])
    parser.add_argument("-v", "--verbose", action="store_true", help="print the lines")
    parser.add_argument("--rev", help="count in this git revision's tree instead of the working tree")
    args = parser.parse_args()
    root = ROOT
    if args.rev:
        import subprocess
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="axis-reach-"))
        command = ["git", "-C", str(ROOT), "archive", args.rev, "hftrain"]
        archive = subprocess.run(command, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    for axis in args.axes:
        found = reach(axis, root)
        cost = shared(found)
        declared = {rel: lines for rel, lines in found.items() if rel not in cost}
        print(f"{axis}: {len(cost)} shared files, {len(declared)} family/task modules declaring a refusal")
        for rel, lines in found.items():
            mark = "  (declares)" if rel in declared else ""
            print(f"  hftrain/{rel}{mark}" + (f": {', '.join(map(str, lines))}" if args.verbose else ""))
    if args.rev:
        import shutil

        shutil.rmtree(root)


if __name__ == "__main__":
    main()
