"""The layers point one way (issue 37): an import graph built from the source (AST; nothing is imported or run)
must have no cycle and no arrow from a lower layer to a higher one. Failures name the file and line.

    core -> accounting -> audit statistics -> models, canaries -> probes -> training -> workflows -> integrations
    -> api, cli

Each package's __init__ docstring says what it may import; LAYERS below is the one table of it.
"""

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Where each import name lives (the design card keeps cli/ and canaries/ at the top of the repository).
ROOTS = {"dpaudit.cli": REPO / "cli", "dpaudit.canaries": REPO / "canaries", "dpaudit": REPO / "dpaudit"}
LAYERS = {  # package (or top-level module) of dpaudit -> its rank; a module may import its own rank or lower
    "core": 0, "accounting": 1, "audit": 2, "models": 3, "canaries": 3, "probes": 4, "training": 5, "workflows": 6,
    "integrations": 7, "api": 8, "cli": 8, "__init__": 8, "samplers": 8,
}


def modules() -> dict[str, Path]:
    found = {}
    for name, root in ROOTS.items():
        for f in sorted(root.rglob("*.py")):
            if name == "dpaudit" and any(f.is_relative_to(r) for n, r in ROOTS.items() if n != "dpaudit"):
                continue
            parts = [p for p in f.relative_to(root).with_suffix("").parts if p != "__init__"]
            found[".".join([name, *parts])] = f
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph():
    mods = modules()
    edges = defaultdict(list)  # module -> [(imported module, line)]
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import sub` imports the package's __init__ too, unless what it names are modules
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t for t in subs if t in mods] or [node.module]
            for t in targets:
                if t in mods and t != name:
                    edges[name].append((t, node.lineno))
    return mods, edges


def test_every_module_is_in_a_layer():
    mods, _ = graph()
    assert not [m for m in mods if layer(m) not in LAYERS], "modules outside every layer"


def test_no_arrow_points_up():
    mods, edges = graph()
    wrong = [f"{mods[a].relative_to(REPO)}:{line} imports {b} ({layer(a)} -> {layer(b)})"
             for a, targets in edges.items() for b, line in targets
             if layer(a) in LAYERS and layer(b) in LAYERS and LAYERS[layer(b)] > LAYERS[layer(a)]]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    mods, edges = graph()
    nodes = {a: sorted({b for b, _ in targets}) for a, targets in edges.items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components, recursive (the graph has a few hundred nodes)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in nodes.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in sorted(mods):
        if v not in index:
            visit(v)
    where = [" <-> ".join(f"{c} ({mods[c].relative_to(REPO)})" for c in cycle) for cycle in cycles]
    assert not cycles, "\n".join(where)


def test_test_files_mirror_the_packages_they_test():
    """tests/<package>/test_<module or subject>.py, one folder per package of dpaudit; only this file (the whole
    code's shape) sits at the top."""
    tests = REPO / "tests"
    loose = sorted(p.name for p in tests.glob("test_*.py") if p.name != "test_layers.py")
    assert not loose, f"test files outside a package folder: {loose}"
    folders = {p.parent.name for p in tests.rglob("test_*.py") if p.parent != tests}
    assert folders <= set(LAYERS) - {"__init__"}, f"test folders that are no package: {sorted(folders - set(LAYERS))}"


def test_every_package_is_in_the_wheel():
    """pyproject's explicit package list names every folder with an __init__.py: one left out is missing from a
    built wheel (`pip install .`) while an editable install, which CI uses, still finds it."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {m for m, f in modules().items() if f.name == "__init__.py"}
    assert found - listed == set(), "packages missing from pyproject.toml's [tool.setuptools] packages"
    assert listed - found == set(), "pyproject.toml lists packages that do not exist"


def test_the_probes_sit_between_the_audit_and_the_trainers():
    """Issue 67: the probes in a room of their own, below training (which attaches them for its white-box runs) and
    above audit (whose statistics they call); no probe module is left in training/."""
    mods, edges = graph()
    probes = [m for m in mods if layer(m) == "probes"]
    assert {"dpaudit.probes.probe", "dpaudit.probes.pipeline_probe", "dpaudit.probes.probe_opacus",
            "dpaudit.probes.health"} <= set(probes)
    assert not [m for m in mods if layer(m) == "training" and m.rsplit(".", 1)[-1] in
                ("probe", "pipeline_probe", "probe_opacus", "health")]
    assert any(b.startswith("dpaudit.probes.") for a, t in edges.items() if layer(a) == "training" for b, _ in t)
    assert any(layer(b) == "audit" for a, t in edges.items() if layer(a) == "probes" for b, _ in t)


# Imports deferred into a function: the heavy optional stacks anywhere (torch and what builds on it, plots), the
# numerical libraries that cost 0.2-0.9 s to import (scipy's submodules, dp-accounting, prv-accountant) and rich's
# widgets where only one path needs them; dpaudit's own modules and numpy only in the modules `dpaudit --help` and
# the closed-form commands load as they run (their start-up is budgeted, benchmarks/startup.py). Everything else at
# the top.
DEFER_ANYWHERE = {"torch", "transformers", "opacus", "peft", "tokenizers", "gguf", "matplotlib", "scipy",
                  "dp_accounting", "prv_accountant", "rich"}
DEFER_ON_START_UP = {"dpaudit", "numpy"}
GATE = {"dpaudit.cli.check_command", "dpaudit.accounting.config"}  # `dpaudit check`: a Laplace config is closed form
CLOSED_FORMS = (["--help"], ["calibrate", "--help"], ["calibrate", "--mech", "laplace", "--eps", "4"],
                ["epsilon", "--mech", "laplace", "--sigma", "10", "--p", "0.01", "-T", "1000"])


def _deferred_imports():
    mods = modules()
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Import):
                        yield name, node, node.names[0].name
                    elif isinstance(node, ast.ImportFrom):
                        yield name, node, node.module or ""


def test_imports_are_deferred_only_for_what_start_up_cannot_pay():
    import subprocess
    import sys

    code = ("import sys\nfrom dpaudit.cli.main import run\n"
            f"for argv in {CLOSED_FORMS!r}:\n    try:\n        run(argv)\n    except SystemExit:\n        pass\n"
            "print('MODULES', ' '.join(sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    start_up = set(out.split("MODULES")[-1].split()) | GATE
    assert "numpy" not in start_up and "torch" not in start_up  # the budget these deferrals keep
    seen, wrong = set(), []
    for name, node, target in _deferred_imports():
        if id(node) in seen:  # a nested function's import is walked from its outer function too
            continue
        seen.add(id(node))
        root = target.split(".")[0]
        if root in DEFER_ANYWHERE or (root in DEFER_ON_START_UP and name in start_up):
            continue
        wrong.append(f"{modules()[name].relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
    assert not wrong, "imports to move to the module's top:\n" + "\n".join(wrong)
    assert len(seen) <= 150, f"{len(seen)} function-local imports"
