"""Every import in pagedserve/ points down the layers, and core/ stays pure Python.

Layers, bottom to top; a module may import modules of its own layer or lower ones:

  0 leaves       pagedserve.config, .sampling_params, .outputs, .messages, .gc_heap, .host_resources
  1 kernels      pagedserve.kernels (the C++ sources and their build)
  2 models       pagedserve.models (attention included)
  3 core, worker pagedserve.core (scheduler, KV cache manager) and pagedserve.worker (model runner, sampler)
  4 engine       pagedserve.engine, pagedserve.tokenizer
  5 cluster      pagedserve.cluster (engine replicas on Ray)
  6 entrypoints  pagedserve.entrypoints, pagedserve.metrics
  7 top          pagedserve.cli, pagedserve.bench, the package root (pagedserve/__init__.py)

Stricter rules on top of the layers:
  - core imports only the leaves, itself and the standard library (no torch, no numpy: pure Python);
  - of core, worker imports only core.sched_output (the scheduler <-> model runner contract);
  - bench is a client of the server: leaves, itself and, inside a function (lazily),
    pagedserve.tokenizer and pagedserve.models.default_model; nothing of engine, core or worker;
  - the package root imports only leaves at module level (its re-exports of upper layers are lazy);
  - entrypoints import cluster only inside a function (lazily: Ray is imported in cluster mode only).

Every import statement counts: at module level, inside functions, and under ``if TYPE_CHECKING:``. A
type-only import still ties the two modules together (and becomes a real import as soon as an
annotation is evaluated or the line is moved), so it obeys the same layers. ``from pagedserve import
X`` counts as an import of the module X is defined in when the root re-exports it (``LLM`` ->
pagedserve.entrypoints.llm), else of the root's own definitions (``__version__``), which are leaf-level.

Only the parse of the sources (ast): no module is imported, no model is loaded.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "pagedserve"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

LEAVES = 0
LAYERS: dict[str, int] = {  # a module (or package, with everything under it) -> its layer
    "pagedserve.config": LEAVES,
    "pagedserve.sampling_params": LEAVES,
    "pagedserve.outputs": LEAVES,
    "pagedserve.messages": LEAVES,
    "pagedserve.gc_heap": LEAVES,
    "pagedserve.host_resources": LEAVES,
    "pagedserve.kernels": 1,
    "pagedserve.models": 2,
    "pagedserve.core": 3,
    "pagedserve.worker": 3,
    "pagedserve.engine": 4,
    "pagedserve.tokenizer": 4,
    "pagedserve.structured": 4,
    "pagedserve.cluster": 5,
    "pagedserve.entrypoints": 6,
    "pagedserve.metrics": 6,
    "pagedserve.cli": 7,
    "pagedserve.bench": 7,
}
ROOT_LAYER = 7  # pagedserve/__init__.py as an importer; as an import target its own names are leaf-level
LAYER_NAMES = {
    0: "leaves",
    1: "kernels",
    2: "models",
    3: "core/worker",
    4: "engine",
    5: "cluster",
    6: "entrypoints",
    7: "top",
}
WORKER_MAY_IMPORT_FROM_CORE = {"pagedserve.core.sched_output"}
BENCH_MAY_IMPORT_LAZILY = {"pagedserve.tokenizer", "pagedserve.models.default_model"}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module: pagedserve.<...>, or a dotted name outside the package
    path: str  # the importing file, for the report
    lineno: int
    in_function: bool
    type_checking: bool

    def where(self) -> str:
        tags = [tag for tag, on in (("in a function", self.in_function), ("TYPE_CHECKING", self.type_checking)) if on]
        return f"{self.path}:{self.lineno}: {self.source} imports {self.target}" + (
            f" [{', '.join(tags)}]" if tags else ""
        )


# ----------------------------------------------------------------- reading the sources
def package_sources(package_dir: Path = PACKAGE_DIR) -> dict[str, tuple[str, str, bool]]:
    """module name -> (file path, source, is a package) for every .py file under ``package_dir``."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (
            str(path.relative_to(package_dir.parent)),
            path.read_text(encoding="utf-8"),
            is_package,
        )
    return modules


def root_exports(root_source: str) -> dict[str, str]:
    """Names the package root binds by importing them (eagerly, lazily or for type checkers) -> their module."""
    exports = {}
    for node in ast.walk(ast.parse(root_source)):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.startswith(PACKAGE + ".")
        ):
            for alias in node.names:
                exports[alias.asname or alias.name] = node.module
    return exports


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(
    module: str, path: str, source: str, is_package: bool, known: set[str], exports: dict[str, str]
) -> list[Import]:
    """Every import statement of one module, each resolved to the module it loads."""
    found: list[Import] = []

    def resolve_from(node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def add(target: str, node: ast.stmt, in_function: bool, type_checking: bool) -> None:
        found.append(Import(module, target, path, node.lineno, in_function, type_checking))

    def visit(nodes: Iterable[ast.AST], in_function: bool, type_checking: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node, in_function, type_checking)
            elif isinstance(node, ast.ImportFrom):
                base = resolve_from(node)
                for alias in node.names:
                    if f"{base}.{alias.name}" in known:  # from pagedserve.models import attention
                        add(f"{base}.{alias.name}", node, in_function, type_checking)
                    elif base == PACKAGE and alias.name in exports:  # from pagedserve import LLM
                        add(exports[alias.name], node, in_function, type_checking)
                    else:
                        add(base, node, in_function, type_checking)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, in_function, True)
                visit(node.orelse, in_function, type_checking)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(ast.iter_child_nodes(node), True, type_checking)
            else:
                visit(ast.iter_child_nodes(node), in_function, type_checking)

    visit(ast.parse(source, filename=path).body, False, False)
    return found


def all_imports(sources: dict[str, tuple[str, str, bool]]) -> list[Import]:
    known = set(sources)
    exports = root_exports(sources[PACKAGE][1]) if PACKAGE in sources else {}
    return [
        imp
        for module, (path, source, is_package) in sources.items()
        for imp in imports_of(module, path, source, is_package, known, exports)
    ]


# ----------------------------------------------------------------- the rules
def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int | None:
    """The layer of a pagedserve module as an importer (the longest matching entry of LAYERS)."""
    if module == PACKAGE:
        return ROOT_LAYER
    matches = [prefix for prefix in LAYERS if _under(module, prefix)]
    return LAYERS[max(matches, key=len)] if matches else None


def target_layer(module: str) -> int | None:
    return LEAVES if module == PACKAGE else layer_of(module)


def _layer(layer: int | None) -> str:
    return "unmapped" if layer is None else f"{layer} {LAYER_NAMES[layer]}"


def violation(imp: Import) -> str | None:
    """Why this import breaks the layering, or None."""
    src, dst = imp.source, imp.target
    src_layer = layer_of(src)
    if src_layer is None:
        return f"{src} is in no layer (add it to LAYERS in tests/test_layering.py)"
    if not _under(dst, PACKAGE):
        top = dst.split(".")[0]
        if _under(src, "pagedserve.core") and top not in sys.stdlib_module_names:
            return "core is pure Python: only the standard library and pagedserve's leaves (no torch, no numpy)"
        return None
    dst_layer = target_layer(dst)
    if dst_layer is None:
        return f"{dst} is in no layer (add it to LAYERS in tests/test_layering.py)"
    if dst_layer > src_layer:
        return f"points up: layer {_layer(src_layer)} -> layer {_layer(dst_layer)}"
    if _under(src, "pagedserve.core") and not (dst_layer == LEAVES or _under(dst, "pagedserve.core")):
        return "core imports only the leaves and core"
    if _under(src, "pagedserve.worker") and _under(dst, "pagedserve.core") and dst not in WORKER_MAY_IMPORT_FROM_CORE:
        return f"worker imports of core only {', '.join(sorted(WORKER_MAY_IMPORT_FROM_CORE))}"
    if _under(src, "pagedserve.bench") and not (dst_layer == LEAVES or _under(dst, "pagedserve.bench")):
        if dst not in BENCH_MAY_IMPORT_LAZILY:
            return "bench is a client: leaves, bench and (lazily) " + ", ".join(sorted(BENCH_MAY_IMPORT_LAZILY))
        if not imp.in_function:
            return f"bench imports {dst} only inside a function (lazily)"
    if _under(src, "pagedserve.entrypoints") and _under(dst, "pagedserve.cluster") and not imp.in_function:
        return "entrypoints import cluster only inside a function (lazily)"
    if src == PACKAGE and not imp.in_function and not imp.type_checking and dst_layer != LEAVES:
        return "the package root imports only leaves at module level (re-export the rest lazily, in __getattr__)"
    return None


def violations(imports: Iterable[Import]) -> Iterator[str]:
    for imp in imports:
        reason = violation(imp)
        if reason is not None:
            yield f"{imp.where()}: {reason}"


# ----------------------------------------------------------------- the tests
def test_imports_point_down_the_layers():
    sources = package_sources()
    assert len(sources) > 50 and "pagedserve.core.scheduler" in sources  # really read the package
    found = list(violations(all_imports(sources)))
    assert not found, f"{len(found)} import(s) break the layering:\n" + "\n".join(found)


def test_every_module_has_a_layer_and_every_entry_a_module():
    sources = package_sources()
    assert [module for module in sources if layer_of(module) is None] == []
    assert [prefix for prefix in LAYERS if not any(_under(module, prefix) for module in sources)] == []


def _check(modules: dict[str, str]) -> list[str]:
    """The violations of synthetic modules (name -> source), checked against the real package as well."""
    sources = package_sources()
    synthetic = {name: (name.replace(".", "/") + ".py", source, False) for name, source in modules.items()}
    found = list(violations(all_imports({**sources, **synthetic})))
    return [line for line in found if any(line.startswith(path + ":") for path, _, _ in synthetic.values())]


def test_the_check_catches_violations():
    found = _check(
        {
            "pagedserve.models.bad_up": "from pagedserve.worker.sampler import Sampler\n",
            "pagedserve.models.bad_relative": "def f():\n    from ..engine import llm_engine\n",
            "pagedserve.core.bad_torch": "def f():\n    import torch\n",
            "pagedserve.core.bad_numpy": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import numpy as np\n",
            "pagedserve.core.bad_worker": "from pagedserve.worker import model_runner\n",
            "pagedserve.core.bad_engine": "import typing\nif typing.TYPE_CHECKING:\n    from pagedserve.engine.llm_engine import LLMEngine\n",
            "pagedserve.worker.bad_core": "from pagedserve.core.scheduler import Scheduler\n",
            "pagedserve.engine.bad_root_export": "from pagedserve import LLM\n",
            "pagedserve.bench.bad_eager": "from pagedserve.tokenizer import load_tokenizer\n",
            "pagedserve.bench.bad_engine": "def f():\n    from pagedserve.engine.async_llm import AsyncLLM\n",
            "pagedserve.kernels.bad_class_body": "class K:\n    from pagedserve.models import layers\n",
            "pagedserve.unmapped_module": "import os\n",
        }
    )
    flagged = {line.split(":", 1)[0] for line in found}
    expected = {
        "pagedserve/models/bad_up.py",
        "pagedserve/models/bad_relative.py",
        "pagedserve/core/bad_torch.py",
        "pagedserve/core/bad_numpy.py",
        "pagedserve/core/bad_worker.py",
        "pagedserve/core/bad_engine.py",
        "pagedserve/worker/bad_core.py",
        "pagedserve/engine/bad_root_export.py",
        "pagedserve/bench/bad_eager.py",
        "pagedserve/bench/bad_engine.py",
        "pagedserve/kernels/bad_class_body.py",
        "pagedserve/unmapped_module.py",
    }
    assert flagged == expected, "\n".join(found)
    assert len(found) == len(expected), "\n".join(found)  # one finding each: the typing/os imports are fine
    assert any("pagedserve.engine.llm_engine [in a function]" in line for line in found)  # relative, resolved
    assert any("pagedserve.entrypoints.llm" in line for line in found)  # a root re-export, resolved


def test_the_check_passes_allowed_imports():
    assert (
        _check(
            {
                "pagedserve.core.fine": "import bisect\nfrom pagedserve.messages import SchedulerStats\nfrom pagedserve.core import request\n",
                "pagedserve.worker.fine": "import torch\nfrom pagedserve.core.sched_output import SchedulerOutput\n"
                "from pagedserve.models.attention import AttentionMetadata\nfrom pagedserve.kernels import load_cpu_kernels\n",
                "pagedserve.engine.fine": "from pagedserve import __version__, SamplingParams\nfrom pagedserve.worker.sampler import Sampler\n",
                "pagedserve.bench.fine": "from pagedserve.gc_heap import freeze_heap\n"
                "def f():\n    from pagedserve.models.default_model import default_model_path\n",
            }
        )
        == []
    )
