"""No import circle in ``st_prompts`` (module- and function-level imports, read with ``ast``), no arrow back up its
layers, and every module imports on its own."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import textwrap
from pathlib import Path

from conftest import CLIProcess

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "st_prompts"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT, package: str = "st_prompts") -> dict[str, set[str]]:
    """``module -> the package's modules it imports`` (at any level of the file), from the source alone."""
    modules = {_module_name(p, root): p for p in (root / package).rglob("*.py")}

    def existing(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {existing(a.name) for a in node.names if a.name.split(".")[0] == package}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != package:
                    continue
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    targets.add(full if full in modules else existing(source))
        graph[name] = {t for t in targets if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (each holds an import circle)."""
    import networkx

    edges = networkx.DiGraph([(name, target) for name, targets in graph.items() for target in targets])
    return sorted(sorted(c) for c in networkx.strongly_connected_components(edges) if len(c) > 1)


def test_the_detector_finds_a_function_level_circle(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import f\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from . import a\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b"]]


def test_st_prompts_has_no_import_circle():
    graph = import_graph()
    assert "st_prompts.folder_checks" in graph and "st_prompts.hub" in graph
    assert cycles(graph) == []
    # the trust checks stand below the models: modules/ uses them, never the loaders that need modules/
    assert not {"st_prompts.modules", "st_prompts.loading"} & graph["st_prompts.folder_checks"]
    assert all("st_prompts.loading" not in targets for name, targets in graph.items()
               if name.startswith("st_prompts.modules"))
    assert "st_prompts.utils" not in graph["st_prompts.hub"]


#: The package's layers, bottom up: a module imports only from its own layer or below (no arrow back up).
LAYERS = (
    ("st_prompts", "errors", "numbers", "aliases", "hub", "utils", "unpickling", "trust", "storage", "sizes",
     "precision"),
    ("prompts", "folder_checks", "quantization"),
    ("modules", "loading"),
    ("data", "evaluation", "losses", "plots", "search"),
    ("methods",),
    ("training", "bank", "embedding"),
    ("serving", "commands", "cli"),
)


def test_no_arrow_runs_back_up():
    layer = {name: level for level, names in enumerate(LAYERS) for name in names}
    graph = import_graph()
    top = {name.split(".")[1] if "." in name else name for name in graph}
    assert top <= set(layer), f"place {sorted(top - set(layer))} in LAYERS"
    back = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if layer[a.split(".")[1] if "." in a else a] < layer[b.split(".")[1] if "." in b else b])
    assert back == []


def test_no_private_name_is_imported_across_modules():
    """A private name is its module's own (a package's private module, ``commands/_numbers.py``, is its package's)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("st_prompts")):
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")
                          and not (a.name.startswith("_") and (node.module or "").endswith("commands"))]
    assert found == []


def third_party_imports() -> list[str]:
    """Every module the package imports that is not its own, and each name imported from one as ``module:name``
    (resolved in the parent, transformers' lazy submodules load once, not once a child), sorted."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] + [f"{node.module}:{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) and not node.level and node.module else [])
            found |= {n for n in names if n.split(".")[0].split(":")[0] not in ("st_prompts", "__future__")}
    return sorted(found)


CHILDREN = textwrap.dedent('''
    import importlib, json, os, sys, traceback
    for name in [m for m in sys.modules if m.split(".")[0] == "st_prompts"]:  # forked from the suite's warm process
        del sys.modules[name]
    for other in json.loads(sys.argv[1]):  # every library the package imports: the children import only st_prompts
        module, _, name = other.partition(":")
        try:
            getattr(importlib.import_module(module), name) if name else importlib.import_module(module)
        except BaseException:
            pass
    assert not [m for m in sys.modules if m.split(".")[0] == "st_prompts"]
    failed = []
    for name in sys.argv[2:]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                importlib.import_module(name)
                code = 0
            except BaseException:
                os.write(write, traceback.format_exc(limit=-3).encode()[-2000:])
                code = 1
            os._exit(code)
        os.close(write)
        message = os.read(read, 4000).decode(errors="replace")
        os.close(read)
        if os.waitpid(pid, 0)[1] != 0:
            failed.append(name + ": " + message)
    print("FAILED:" + "\\n".join(failed) if failed else "ALL IMPORTED")
''')


def test_every_module_imports_alone():
    """A child forked per module from a parent that imported every library the package imports, no st_prompts."""
    names = sorted(n for n in import_graph() if n != "st_prompts.__main__")
    process = CLIProcess([json.dumps(third_party_imports()), *names], dict(os.environ), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=str(ROOT), code=CHILDREN)
    out, err = process.stdout.read(), process.stderr.read()
    assert process.wait(900) == 0 and out.strip().endswith("ALL IMPORTED"), out[-4000:] + err[-2000:]
