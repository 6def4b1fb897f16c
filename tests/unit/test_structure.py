"""The package layout: no import cycles, small packages, a README per package, layers that import
in one direction. The import graph is built from the source with ``ast`` (every import statement,
lazy ones inside functions included), so nothing has to be imported to check it."""
import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "nereus"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def import_graph() -> nx.DiGraph:
    """Module -> every ``nereus`` module it imports (``from pkg import name`` counts as an import of
    ``pkg.name`` when that is a module, of ``pkg`` otherwise)."""
    mods = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base_mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    base_mod = node.module or ""
                targets = [f"{base_mod}.{a.name}" if f"{base_mod}.{a.name}" in mods else base_mod for a in node.names]
            for t in targets:
                if t in mods and t != mod:
                    g.add_edge(mod, t)
    return g


def test_the_import_graph_has_no_cycles():
    g = import_graph()
    assert g.number_of_edges() > 100, "the graph builder found almost no imports: it is broken"
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    """The checker itself: two modules importing each other (one lazily) form a cycle."""
    pkg = tmp_path / "nereus"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from nereus.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from nereus import a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    assert list(nx.simple_cycles(import_graph())) != []


def _layer_edges(src: str, dst: str) -> list[tuple[str, str]]:
    return [(a, b) for a, b in import_graph().edges if a.startswith(src) and b.startswith(dst)]


@pytest.mark.parametrize("src,dst", [("nereus.planner", "nereus.simulator"), ("nereus.planner", "nereus.executor"),
                                     ("nereus.planner", "nereus.calibration"), ("nereus.planner", "nereus.demo"),
                                     ("nereus.models", "nereus.planner"), ("nereus.executor", "nereus.planner.solver"),
                                     ("nereus.simulator", "nereus.executor")])
def test_layers_import_in_one_direction(src, dst):
    assert _layer_edges(src, dst) == []


def test_no_package_holds_more_than_14_modules():
    for d in [ROOT] + [p for p in ROOT.rglob("*") if p.is_dir() and p.name != "__pycache__"]:
        n = len(list(d.glob("*.py")))
        assert n <= 14, f"{d.relative_to(ROOT.parent)} holds {n} modules (at most 14)"


def test_every_package_with_three_modules_has_a_readme_naming_each_file():
    for d in [ROOT] + [p for p in ROOT.rglob("*") if p.is_dir() and p.name != "__pycache__"]:
        files = sorted(p.name for p in d.glob("*.py") if p.name != "__init__.py")
        if len(files) < 3:
            continue
        readme = d / "README.md"
        assert readme.exists(), f"{d.relative_to(ROOT.parent)} has {len(files)} modules and no README.md"
        text = readme.read_text()
        missing = [f for f in files if f"`{f}`" not in text]
        assert not missing, f"{readme.relative_to(ROOT.parent)} does not name {missing}"
