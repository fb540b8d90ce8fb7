"""The layers hold: each part of ctxlaunch imports only the layers before it, read from the
code's own import statements (module level and inside functions alike).

    contract -> perf -> planning -> launch | runtime -> cli        cp: torch only
                                    launch -> api -> cli

launch (what submits a job) and runtime (what runs inside it) never import each other: they meet
in contract (the spec that travels with the job, the run directory, the exit files)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

PACKAGE = ROOT / "ctxlaunch"

ALLOWED: dict[str, set[str]] = {
    "contract": {"contract"},
    "perf": {"contract", "perf"},
    "planning": {"contract", "perf", "planning"},
    "launch": {"contract", "perf", "planning", "launch"},
    "runtime": {"contract", "perf", "planning", "runtime", "cp"},
    "cp": {"cp"},
    "api": {"contract", "perf", "planning", "launch", "api"},
    "cli": {"contract", "perf", "planning", "launch", "runtime", "cp", "api", "cli"},
}
"""Layer -> the layers its modules may import. The package root (`ctxlaunch`, which holds only
the version) is open to all."""


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute module) for every ctxlaunch import in the file of package `root`."""
    tree = ast.parse(path.read_text(), str(path))
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "ctxlaunch":
                # `from ctxlaunch import x`: x is the module (or the version)
                found += [(node.lineno, f"ctxlaunch.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
    return [(line, name) for line, name in found if name.split(".")[0] == "ctxlaunch"]


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_every_module_is_in_a_layer() -> None:
    """Nothing loose at the top: each module belongs to a layer."""
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    loose += [
        p.name
        for p in PACKAGE.iterdir()
        if p.is_dir() and p.name not in ALLOWED and p.name != "__pycache__"
    ]
    assert loose == [], f"modules outside the layers: {loose}"


def test_entry_modules_run_inside_the_runtime_layer() -> None:
    """The modules a rendered job starts (`python -m ...`) are runtime modules that run as a
    program: a package with a __main__, or a module with a main guard."""
    from ctxlaunch.contract.rundir import CALIBRATE_MODULE, EVAL_MODULE, POD_MODULE, TRAINER_MODULE

    for module in (TRAINER_MODULE, POD_MODULE, CALIBRATE_MODULE, EVAL_MODULE):
        assert _layer(module) == "runtime", module
        path = PACKAGE.parent.joinpath(*module.split("."))
        runnable = (path / "__main__.py").is_file() or (
            path.with_suffix(".py").is_file()
            and 'if __name__ == "__main__":' in path.with_suffix(".py").read_text()
        )
        assert runnable, f"{module} does not run with python -m"


def _violations(layer: str, root: Path = PACKAGE) -> list[str]:
    """Every import in `layer` of the package at `root` that the layers forbid."""
    wrong = []
    for path in sorted((root / layer).rglob("*.py")):
        for line, target in _imports(path, root):
            if target == "ctxlaunch":
                continue
            target_layer = _layer(target)
            if target_layer is not None and target_layer not in ALLOWED[layer]:
                wrong.append(
                    f"{path.relative_to(root)}:{line} imports {target} "
                    f"({layer} may import {', '.join(sorted(ALLOWED[layer]))})"
                )
    return wrong


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_earlier_layers(layer: str) -> None:
    wrong = _violations(layer)
    assert wrong == [], "\n".join(wrong)


RUNTIME_ROOMS = ("modeling", "checkpointing", "parallel", "evaluation", "trainer")
"""The trainer's rooms under runtime/, in order: a room imports only the rooms before it (and
the runtime's shared modules: data, records, progress, telemetry), so the model never knows a
process group, checkpoints never know the mesh, and only the trainer knows the loop."""


def _room(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "runtime" and parts[2] in RUNTIME_ROOMS:
        return parts[2]
    return None


def test_runtime_rooms_import_only_earlier_rooms() -> None:
    wrong = []
    for path in sorted((PACKAGE / "runtime").rglob("*.py")):
        room = _room(_module_name(path))
        if room is None:
            continue
        allowed = RUNTIME_ROOMS[: RUNTIME_ROOMS.index(room) + 1]
        for line, target in _imports(path):
            target_room = _room(target)
            if target_room is not None and target_room not in allowed:
                wrong.append(
                    f"{path.relative_to(PACKAGE)}:{line} imports {target} ({room} may import "
                    f"{', '.join(allowed)})"
                )
    assert wrong == [], "\n".join(wrong)


def test_the_shared_runtime_modules_import_no_room() -> None:
    """data, records, progress, telemetry and tether serve every room, so they import none of
    them."""
    shared = ["data", "telemetry", "records.py", "progress.py", "tether.py"]
    wrong = [
        f"{path.relative_to(PACKAGE)}:{line} imports {target}"
        for name in shared
        for path in sorted(
            (PACKAGE / "runtime" / name).rglob("*.py")
            if not name.endswith(".py")
            else [PACKAGE / "runtime" / name]
        )
        for line, target in _imports(path)
        if _room(target) is not None
    ]
    assert wrong == [], "\n".join(wrong)


def test_the_rule_sees_a_violation(tmp_path: Path) -> None:
    """The checker itself: an upward import inside a function is found. The probe is written
    into a package of its own under tmp_path, never into the source tree, where the linters
    that another test worker runs at the same time would read it."""
    root = tmp_path / "ctxlaunch"
    (root / "perf").mkdir(parents=True)
    bad = root / "perf" / "_layer_probe.py"
    bad.write_text("def f():\n    from ctxlaunch.launch import jobstore\n")
    assert _imports(bad, root) == [(2, "ctxlaunch.launch")]
    assert _violations("perf", root) == [
        "perf/_layer_probe.py:2 imports ctxlaunch.launch (perf may import contract, perf)"
    ]
    relative = root / "perf" / "_relative_probe.py"
    relative.write_text("from ..planning import advise\n")
    assert _imports(relative, root) == [(1, "ctxlaunch.planning")]


def _module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in the file (inside functions and
    under TYPE_CHECKING too). `from package import name` counts as importing the submodule
    `package.name` where there is one, else the package itself."""
    modules = {_module_name(path, root): path for path in root.rglob("*.py")}

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                    for alias in node.names
                ]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.split(".")[0] == root.name else None
                if found is not None and found != module:
                    edges.add(found)
        graph[module] = edges
    return graph


def _import_circles(root: Path = PACKAGE) -> list[list[str]]:
    """Every set of modules that import each other round a circle (strongly connected
    components of more than one module), each sorted."""
    graph = _module_graph(root)
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return sorted(circles)


def test_no_import_circle_anywhere_in_the_package() -> None:
    """Within a layer too: no module imports, through others, a module that imports it."""
    circles = _import_circles()
    assert circles == [], "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_check_sees_a_circle(tmp_path: Path) -> None:
    """The checker itself, on a package of its own under tmp_path: a circle through an import
    inside a function and a `from package import module` is found; a straight line is not."""
    root = tmp_path / "ctxlaunch"
    (root / "perf").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "perf" / "__init__.py").write_text("")
    (root / "perf" / "a.py").write_text("from ctxlaunch.perf import b\n")
    (root / "perf" / "b.py").write_text("def f():\n    from . import c\n")
    (root / "perf" / "c.py").write_text("import ctxlaunch.perf.d\n")
    (root / "perf" / "d.py").write_text("")
    assert _import_circles(root) == []
    (root / "perf" / "d.py").write_text("from ctxlaunch.perf.a import x\n")
    assert _import_circles(root) == [
        ["ctxlaunch.perf.a", "ctxlaunch.perf.b", "ctxlaunch.perf.c", "ctxlaunch.perf.d"]
    ]


def test_every_module_name_is_unique() -> None:
    """A module's name says which one it is: no two modules (or a module and a package) share
    a name anywhere in the package, so a search for it finds the one place."""
    names: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE)))
    for path in PACKAGE.rglob("*/"):
        if path.is_dir() and path.name != "__pycache__" and (path / "__init__.py").exists():
            names.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)) + "/")
    twice = {name: places for name, places in names.items() if len(places) > 1}
    assert twice == {}, f"module names used twice: {twice}"


# --------------------------------------------------------------------------------------------
# Around the package: the tests, the benchmarks and what they share (devkit).

AROUND: dict[str, set[str]] = {
    "tests": {"benchmarks"},
    "benchmarks": {"tests"},
    "devkit": {"tests", "benchmarks"},
}
"""Folder -> the top-level folders its files may not import: the benchmarks measure without the
tests' helpers and the tests check without the benchmarks; both share devkit, which needs
neither."""


def top_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level name) of every absolute import in the file, inside functions too."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_benchmarks_and_tests_do_not_import_each_other() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for folder, forbidden in AROUND.items()
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, name in top_level_imports(path)
        if name in forbidden
    ]
    assert wrong == [], "move what both need into devkit/:\n" + "\n".join(wrong)


def test_the_import_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "bench.py"
    module.write_text("import os\n\ndef f():\n    from tests.helpers.memtrace import x\n")
    assert top_level_imports(module) == [(1, "os"), (4, "tests")]
