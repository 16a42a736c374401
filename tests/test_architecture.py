"""The import graph holds the architecture's directions (docs/ARCHITECTURE.md).

Every ``import`` / ``from ... import`` of the project's modules (at any depth: lazy imports inside
functions count too) is read with :mod:`ast`, relative imports resolved, and each rule checked:
data flows browser -> ``app`` -> ``engine`` -> ``ops``; inside ``engine`` the wings point one way
(``model`` at the bottom, then ``cache``, ``graphs``, ``inputs``, then the serving core, and only
``engine/engine.py`` on top of them all, then ``engine/client.py``, the interface the app talks to).
A broken rule names the module and the line.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "ops", "sessions", "app")
WINGS = ("model", "cache", "graphs", "inputs", "serving", "parallel")
#: What the engine's top level may hold (modules and shims), besides the wings' folders.
TOP_LEVEL_LIMIT = 8


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports(name: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """``(imported module, line)`` of every import in the module ``name`` (relative ones resolved;
    ``from X import y`` counts as importing ``X`` and, where it is a module, ``X.y``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.append((target, node.lineno))
            found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
    return found


def within(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


MODULES = project_modules()
GRAPH = {name: [(t, line) for t, line in imports(name, path) if t in MODULES] for name, path in MODULES.items()}

#: (who, what they must never import, why): "who" and "what" are module prefixes.
RULES = [
    ("ops", ("engine", "sessions", "app"), "kernels know nothing of the engine, the store or the web"),
    ("engine", ("sessions", "app"), "the engine knows nothing of sessions or the web (only an opaque salt)"),
    ("sessions", ("app",), "the store knows nothing of the web"),
    ("engine.serving", ("engine.engine", "engine.options"), "the serving core never calls back into Engine"),
    ("engine.model", ("engine.cache", "engine.graphs", "engine.inputs", "engine.serving", "engine.parallel"),
     "the model is plain: storage, capture, inputs and serving wrap it from outside"),
    ("engine.cache", ("engine.serving", "engine.graphs", "engine.inputs", "engine.parallel"),
     "caches are driven by the serving core, never the other way round"),
    ("engine.graphs", ("engine.serving", "engine.inputs", "engine.parallel"),
     "graphs capture the model over the pool, nothing more"),
    ("engine.inputs", ("engine.serving", "engine.parallel"), "inputs are built before serving sees them"),
    ("engine.serving", ("engine.parallel",),
     "the serving core is the single-process path; tensor parallelism wraps it from outside"),
    ("engine.parallel", ("engine.inputs",), "rank 0 encodes images; the parallel wing only carries features"),
    ("app", ("engine.engine",),
     "the app talks to an EngineClient (engine.client: in-process or the core in a child process), not to Engine"),
]
#: Top-level modules a wing must never import: the public API, the engine clients and the shims
#: (``engine.errors`` is shared by all).
TOP = ("engine.engine", "engine.options", "engine.media", "engine.client", "engine.tiny", "engine.hub",
       "engine.replicas")
#: The engine's public modules, all that ``sessions/`` and ``app/`` may import of it
#: (docs/ARCHITECTURE.md): the package root (``Engine``, ``EngineOptions``, ``SamplingParams``, ...),
#: ``engine.media`` (validating uploads), ``engine.client`` (what the app talks to), ``engine.errors``
#: and the shims ``engine.tiny`` and ``engine.hub``. The wings are the engine's internals.
PUBLIC = ("engine", "engine.media", "engine.client", "engine.errors", "engine.tiny", "engine.hub",
          "engine.replicas")


def violations(who: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{name} (line {line}) imports {target}"
            for name, edges in GRAPH.items() if within(name, who)
            for target, line in edges if any(within(target, f) for f in forbidden)]


@pytest.mark.parametrize(("who", "forbidden", "why"), RULES, ids=[r[0] for r in RULES])
def test_import_directions(who, forbidden, why):
    assert any(within(name, who) for name in MODULES), f"no modules under {who}: the rule checks nothing"
    assert not violations(who, forbidden), f"{why}: " + "; ".join(violations(who, forbidden))


@pytest.mark.parametrize("wing", WINGS)
def test_wings_never_import_the_public_api_or_the_shims(wing):
    """A wing imports its peers and ``engine.errors``, never the package root (which imports the
    whole engine), ``engine.engine``, ``engine.options``, ``engine.client`` (which wraps the engine
    from outside, in this process or another) or the shims."""
    who = f"engine.{wing}"
    assert any(within(name, who) for name in MODULES), f"no wing {who}"
    bad = [f"{name} (line {line}) imports {target}"
           for name, edges in GRAPH.items() if within(name, who)
           for target, line in edges if target == "engine" or any(within(target, t) for t in TOP)]
    assert not bad, "; ".join(bad)


def internal_imports(who: str) -> list[str]:
    """Imports of the engine's modules outside :data:`PUBLIC` by the modules under ``who``."""
    return [f"{name} (line {line}) imports {target}"
            for name, edges in GRAPH.items() if within(name, who)
            for target, line in edges if within(target, "engine") and target not in PUBLIC]


@pytest.mark.parametrize("who", ["sessions", "app"])
def test_the_store_and_the_app_import_only_the_engines_public_modules(who):
    """``sessions/`` and ``app/`` see the engine through its public modules only (lazy imports
    too): the wings can change without breaking them."""
    assert any(within(name, who) and any(within(t, "engine") for t, _ in GRAPH[name]) for name in MODULES), \
        f"nothing under {who} imports the engine: the rule checks nothing"
    assert not internal_imports(who), "; ".join(internal_imports(who))


def test_an_import_of_an_engine_internal_is_caught(monkeypatch):
    """The rule above fails on the edge it guards: a store importing ``engine.inputs.images``
    (what ``sessions/store.py`` did before ``engine.media``)."""
    monkeypatch.setitem(GRAPH, "sessions.store", [*GRAPH["sessions.store"], ("engine.inputs.images", 1)])
    assert internal_imports("sessions") == ["sessions.store (line 1) imports engine.inputs.images"]


def test_the_wings_form_no_cycle():
    """Wing-level dependencies (which wing imports which) are acyclic: model < cache / graphs <
    inputs < serving, with ``engine.engine`` above them all."""
    deps = {w: set() for w in WINGS}
    for name, edges in GRAPH.items():
        wing = name.split(".")[1] if name.count(".") >= 1 and name.split(".")[0] == "engine" else None
        if wing not in deps:
            continue
        for target, _ in edges:
            parts = target.split(".")
            if parts[0] == "engine" and len(parts) > 1 and parts[1] in deps and parts[1] != wing:
                deps[wing].add(parts[1])
    order, seen = [], set()

    def visit(wing, path=()):
        assert wing not in path, f"wing cycle: {' -> '.join((*path, wing))}"
        if wing not in seen:
            for dep in sorted(deps[wing]):
                visit(dep, (*path, wing))
            seen.add(wing)
            order.append(wing)

    for wing in WINGS:
        visit(wing)
    assert order.index("model") < order.index("serving") < order.index("parallel")


def test_the_replica_ring_is_pure_and_ray_stays_in_the_replicas_package():
    """``engine/replicas/ring.py`` imports only the standard library (its tests need neither Ray
    nor an engine); nothing outside ``engine/replicas/`` imports Ray (the app and the engine run
    without it unless ``--replicas`` is given)."""
    ring = [t for t, _ in imports("engine.replicas.ring", MODULES["engine.replicas.ring"])]
    assert ring and not [t for t in ring if t.split(".")[0] in ("engine", "ray", "torch", "app", "sessions")], ring
    ray_users = [name for name, path in MODULES.items()
                 if any(t.split(".")[0] == "ray" for t, _ in imports(name, path))]
    assert ray_users and all(within(name, "engine.replicas") for name in ray_users), ray_users


def test_engine_top_level_is_small():
    """The folder listing shows the architecture: the wings, and at most a handful of modules
    beside them (``__init__``, ``engine``, ``options``, ``errors``, ``client`` and the shims)."""
    top = sorted(p.name for p in (ROOT / "engine").glob("*.py"))
    assert len(top) <= TOP_LEVEL_LIMIT, top
    for wing in WINGS:
        assert (ROOT / "engine" / wing / "__init__.py").is_file(), f"engine/{wing}/ is missing"
