"""The simulator's ground truth shares no code with the planner's cost model: its modules import only
specs, plan data types, model shapes, errors and each other (checked from the source with ``ast``,
lazy imports inside functions included, and transitively through what they import)."""
import ast
import pathlib

TRUTH = pathlib.Path(__file__).resolve().parents[2] / "nereus" / "simulator" / "truth"
ALLOWED = ("nereus.planner.specs", "nereus.planner.plan", "nereus.models", "nereus.errors", "nereus.jsonio",
           "nereus.simulator.truth")
FORBIDDEN = ("nereus.planner.cost", "nereus.planner.solver", "nereus.planner.transition", "nereus.planner.online")


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the truth package
                out.add("nereus.simulator.truth" + (f".{node.module}" if node.module else ""))
            elif node.module:
                out.add(node.module)
                out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.split(".")[0] == "nereus"}


def _module_path(mod: str) -> pathlib.Path | None:
    base = TRUTH.parents[2] / pathlib.Path(*mod.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.exists():
            return p
    return None


def test_truth_modules_import_only_specs_plans_and_models():
    files = sorted(TRUTH.glob("*.py"))
    assert len(files) >= 8, files  # the package is there (an empty glob would pass vacuously)
    for f in files:
        for mod in _imports(f):
            assert mod.startswith(ALLOWED), f"{f.name} imports {mod}"
            assert not mod.startswith(FORBIDDEN), f"{f.name} imports {mod}"


def test_nothing_the_truth_imports_reaches_the_cost_model_transitively():
    seen, todo = set(), [f"nereus.simulator.truth.{f.stem}" for f in TRUTH.glob("*.py")]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        assert not mod.startswith(FORBIDDEN), f"the ground truth reaches {mod}"
        path = _module_path(mod)
        if path is not None:
            todo += sorted(_imports(path))
    assert "nereus.planner.specs" in seen and "nereus.models.spec" in seen


def test_the_checker_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from nereus.planner.cost.model import estimate\n")
    assert "nereus.planner.cost.model" in _imports(bad)
