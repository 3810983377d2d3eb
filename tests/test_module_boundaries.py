"""The package's seams, read from its source (no import runs): the simulator and the bench do
not lean on each other, and no module reaches for another module's private names.

A private name (`_x`) is its module's own business: a module that needs it from elsewhere
gets a public name for it. A private submodule (`ubep._preload`) may be imported within its
own package.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import ubep

SRC = Path(ubep.__file__).parent


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = ["ubep", *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = (path, ast.parse(path.read_text(), str(path)))
    return out


MODULES = _modules()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports(module: str, path: Path, tree: ast.Module):
    """`(line, source module, imported name or None)` of every ubep import in `tree`; `names`
    maps each local name bound to a ubep module to that module."""
    pkg = _package(module, path)
    found, names = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                src = base + (f".{node.module}" if node.module else "")
            else:
                src = node.module or ""
            if src.split(".")[0] != "ubep":
                continue
            for alias in node.names:
                found.append((node.lineno, src, alias.name))
                if f"{src}.{alias.name}" in MODULES:
                    names[alias.asname or alias.name] = f"{src}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ubep":
                    found.append((node.lineno, alias.name, None))
                    if alias.asname:
                        names[alias.asname] = alias.name
    return found, names


def _allowed_private_module(importer: str, path: Path, target: str) -> bool:
    """A private submodule imported from within the package that holds it."""
    parent = target.rpartition(".")[0]
    pkg = _package(importer, path)
    return pkg == parent or pkg.startswith(parent + ".")


def test_no_module_imports_a_private_name_of_another():
    bad = []
    for module, (path, tree) in MODULES.items():
        found, names = _imports(module, path, tree)
        for line, src, name in found:
            parts = src.split(".")
            for i, part in enumerate(parts):
                target = ".".join(parts[:i + 1])
                if _private(part) and not _allowed_private_module(module, path, target):
                    bad.append(f"{path.name}:{line} imports private module {target}")
            if name is not None and _private(name) and src != module:
                target = f"{src}.{name}"
                if not (target in MODULES and _allowed_private_module(module, path, target)):
                    bad.append(f"{path.name}:{line} imports {name} from {src}")
        for node in ast.walk(tree):     # `module._name` through a name bound to a module
            if (isinstance(node, ast.Attribute) and _private(node.attr)
                    and isinstance(node.value, ast.Name) and node.value.id in names
                    and names[node.value.id] != module):
                bad.append(f"{path.name}:{node.lineno} reads {names[node.value.id]}."
                           f"{node.attr}")
    assert not bad, "\n".join(bad)


def test_the_simulator_and_the_bench_keep_apart():
    """`ubep.sim` imports nothing of `ubep.bench`; `ubep.bench` nothing private of
    `ubep.sim` (the first test covers private names; this pins the direction)."""
    bad = []
    for module, (path, tree) in MODULES.items():
        if not module.startswith("ubep.sim"):
            continue
        found, _ = _imports(module, path, tree)
        bad += [f"{path.name}:{line} imports {src}" for line, src, name in found
                if src == "ubep.bench" or src.startswith("ubep.bench.")
                or (src == "ubep" and name == "bench")]
    assert not bad, "\n".join(bad)


def test_the_checks_see_the_package():
    """The tests above read every module: a broken walk would pass them vacuously."""
    assert {"ubep.buffer", "ubep.sim.api", "ubep.bench.runner", "ubep.runtime"} <= set(MODULES)
    found, _ = _imports("ubep.bench.runner", *MODULES["ubep.bench.runner"])
    assert (found and all(src.startswith("ubep") for _, src, _ in found)
            and any(src == "ubep.bench.flags" for _, src, _ in found))


def _graph() -> dict[str, set[str]]:
    """Every import between ubep modules, at the top, in a function or under
    TYPE_CHECKING alike; a submodule's import of a package that holds it is left out (Python
    imports the package first in any case)."""
    graph: dict[str, set[str]] = {}
    for module, (path, tree) in MODULES.items():
        found, _ = _imports(module, path, tree)
        targets = set()
        for _, src, name in found:
            target = f"{src}.{name}" if name and f"{src}.{name}" in MODULES else src
            if target in MODULES and target != module and not module.startswith(target + "."):
                targets.add(target)
        graph[module] = targets
    return graph


def test_no_import_cycle_lazy_or_not():
    graph = _graph()
    assert "ubep.quant" in graph["ubep.buffer"] and "ubep.ops" in graph["ubep.buffer"]
    seen: dict[str, int] = {}        # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        seen[m] = 1
        for t in sorted(graph[m]):
            if seen.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [m, t]))
            elif t not in seen:
                visit(t, path + [m])
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m, [])
    assert not cycles, "\n".join(cycles)


def _members(cls) -> set[str]:
    """The names `Backend` declares: its methods and annotated attributes."""
    return ({n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
            | set(getattr(cls, "__annotations__", {})))


def test_every_backend_offers_what_buffer_calls():
    """`Backend` declares each name `Buffer` calls on its backend, and each backend has them
    all (its own or the protocol's defaults), so `Buffer` asks no backend with `getattr`."""
    from ubep.runtime import Backend
    from ubep.runtime.shm.backend import ShmBackend
    from ubep.runtime.torch_backend import TorchBackend

    declared = _members(Backend)
    path, tree = MODULES["ubep.buffer"]
    called = {node.attr for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and node.value.attr == "_backend"}
    assert called and called <= declared, sorted(called - declared)
    asked = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, "id", None) == "getattr" and node.args
             and isinstance(node.args[0], ast.Attribute) and node.args[0].attr == "_backend"]
    assert not asked, f"buffer.py asks its backend with getattr at lines {asked}"
    for cls in (ShmBackend, TorchBackend):
        missing = {name for name in declared if not hasattr(cls, name)}
        # an attribute set per instance counts where the constructor sets it
        missing -= {name for name in missing
                    if f"self.{name} =" in inspect.getsource(cls.__init__)}
        assert not missing, (cls.__name__, sorted(missing))
