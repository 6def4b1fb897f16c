import subprocess
import sys


def test_planner_and_models_do_not_import_torch():
    code = ("import sys, nereus.models, nereus.planner, nereus.planner.cost.model, nereus.cli; "
            "import pkgutil, importlib, nereus.planner as P; "
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages(P.__path__, 'nereus.planner.')]; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr or "torch was imported by the planner"


def test_executor_does_not_import_solvers():
    code = ("import sys, pkgutil, importlib, nereus.executor as E; "
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages(E.__path__, 'nereus.executor.')]; "
            "bad = [m for m in ('ortools', 'pulp') if m in sys.modules]; sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr or "the executor imported a solver"
