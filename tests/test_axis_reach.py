"""``scripts/axis_reach.py``: a file counts for an axis when its code names it, outside that axis's own modules only;
docstrings and comments do not count, a string argument on a continuation line does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("axis_reach", ROOT / "scripts" / "axis_reach.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_counts_code_outside_the_axis_modules_only(tmp_path):
    reach = _script()
    files = {
        "parallel/context_parallel.py": "cp_group = 1\n",  # cp's own module: exempt for cp
        "parallel/axes.py": 'SPECS = (\n    Spec(\n        "cp",\n        "context parallel",\n    ),\n)\n',
        "parallel/dims.py": '"""Names cp in the docstring only."""\n\n# and cp in a comment\nx = 1\n',
        "config/schema.py": 'KEYS = {"parallelism.cp": 1}\n',
        "other.py": 'def f():\n    """cp_rank in a docstring."""\n    return g(\n        "cp"\n    )\n',
        "tensor.py": "tp_rank = 0  # tp names only\n",
    }
    for rel, text in files.items():
        path = tmp_path / "hftrain" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    found = reach.reach("cp", tmp_path)
    # the declaration and the schema count (no longer exempt), so does an argument on its own line
    assert found == {"parallel/axes.py": [3], "config/schema.py": [1], "other.py": [4]}
    assert reach.reach("tp", tmp_path) == {"tensor.py": [1]}
