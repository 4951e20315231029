"""The house's layers, measured from the imports: no import circle among the repository's modules, and no
import from a lower layer (`model`, `kernels_cuda`) into a higher one (`parallel`, then `moe_train`, then
the scripts and benchmarks that drive it)."""
from __future__ import annotations

from pathlib import Path

from tests.unit.import_graph import cycles, import_graph, upward_imports

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"model": 0, "kernels_cuda": 0, "parallel": 1, "moe_train": 2, "scripts": 3, "benchmarks": 3}
PACKAGES = tuple(LAYERS)


def test_no_import_circle():
    assert cycles(import_graph(ROOT, PACKAGES)) == []


def test_no_lower_layer_imports_a_higher_one():
    assert upward_imports(import_graph(ROOT, PACKAGES), LAYERS) == []


def test_the_graph_sees_lazy_relative_and_package_imports(tmp_path):
    """The reader itself, on a small tree: a lazy import closing a circle, a relative import, an import
    through a package's __init__, and a type-only import (which is no edge)."""
    files = {
        "low/__init__.py": "from .a import A\n",
        "low/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from low.b import B\nA = 1\n",
        "low/b.py": "def f():\n    from . import c\n",
        "low/c.py": "import low.b\n",
        "high/__init__.py": "",
        "high/d.py": "from low import A\n",
        "low/e.py": "def g():\n    from high import d\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("low", "high"))
    assert graph["low"] == {"low.a"}
    assert graph["low.a"] == set()
    assert graph["high.d"] == {"low"}
    assert cycles(graph) == [["low.b", "low.c"]]
    assert upward_imports(graph, {"low": 0, "high": 1}) == [("low.e", "high.d")]
