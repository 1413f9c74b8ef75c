"""The package's import structure (docs/design/architecture.md, "Import rules"): no import cycle between
modules, and the forbidden directions between layers.

Every module under ``asyncrl/`` and ``app/`` (installed as ``asyncrl.app``) is parsed with :mod:`ast` (nothing is imported or run).
Every ``import`` and ``from ... import`` counts, wherever it stands: at the top, inside a function,
under ``if TYPE_CHECKING``. Relative imports are resolved against the module's package;
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``.
Imports made by name at run time (``importlib.import_module``, ``algorithm: pkg.module:Class``
config strings) are plugin look-ups and are not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

# package -> its folder: the UI's top-level app/ folder is the package asyncrl.app (setup.py's package_dir)
PACKAGES = {"asyncrl": "asyncrl", "asyncrl.app": "app"}

# The code that runs in an actor process: it must never need the learner's code.
ACTOR_SIDE = (
    "asyncrl.actor",
    "asyncrl.rollout",
    "asyncrl.algos",
    "asyncrl.engine",
    "asyncrl.endpoint",
    "asyncrl.envs",
    "asyncrl.sandbox",
    "asyncrl.prompts",
    "asyncrl.objectives",
    "asyncrl.models",
    "asyncrl.weights",
    "asyncrl.wire",
)

# An algorithm's tab in the UI (asyncrl.app.kit.AlgorithmView): its package's top floor, loaded by path by the UI
# alone; it may read the run analysis and the UI's toolkit, and nothing imports it.
ALGO_UI = ("asyncrl.algos.*.ui",)

# (importer prefixes, imported prefixes, why[, importers exempted]): an edge from the first to the
# second is an error. A ``*`` in a prefix stands for one dotted name.
FORBIDDEN = [
    (ACTOR_SIDE, ("asyncrl.learner",), "code that runs on an actor never imports the learner"),
    (("asyncrl.models",), ("asyncrl.algos",), "models know no algorithm (workflows pass their warm-start formats)"),
    (("asyncrl.app",), ("asyncrl.commands",), "the UI app does not import the command line (the CLI starts the app)"),
    (("asyncrl.analysis",), ("asyncrl.app",), "run analysis is UI-free (the app reads it, not the other way)"),
    (
        ("asyncrl.rundir",),
        ("asyncrl.learner",),
        "the run directory sits below the learner (paths, records, the run log, the start-up rules)",
    ),
    (("asyncrl.engine",), ("asyncrl.models",), "engines run a loaded model; they do not build or load one"),
    (("asyncrl.models",), ("asyncrl.engine",), "building a model needs no engine (init_model measures it)"),
    (
        ("asyncrl.algos",),
        ("asyncrl.analysis", "asyncrl.app"),
        "algorithms sit below the run analysis and the UI that read their records (but for their UI tab)",
        ALGO_UI,
    ),
    (
        ("asyncrl.analysis", "asyncrl.learner", "asyncrl.app"),
        ("asyncrl.algos",),
        "the generic layers name no algorithm: an "
        "algorithm registers its tables, views and trained-sample filter with its workflow",
    ),
    (
        ("asyncrl",),
        ("asyncrl.testing",),
        "the test harnesses (asyncrl.testing) serve the tests and benchmarks, not the package",
        ("asyncrl.testing",),
    ),
    (("asyncrl",), ALGO_UI, "an algorithm's UI tab is loaded by the UI by its import path (Workflow.views)"),
]

# The ground floor: modules any layer may import, which import no other asyncrl module but each other.
GROUND = ("asyncrl.rundir.layout", "asyncrl.rundir.record_file", "asyncrl.types")


def ground_floor_edges(graph: dict[str, set[str]], ground=GROUND) -> list[str]:
    """One line per import from a ground-floor module to a module above it."""
    return [
        f"{m} -> {i}: the ground floor imports only the ground floor"
        for m in sorted(graph)
        if _within(m, ground)
        for i in sorted(graph[m])
        if not _within(i, ground)
    ]


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root/<package>`` (a package's
    ``__init__.py`` is the package's own name)."""
    out = {}
    for package, folder in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [*package.split("."), *path.relative_to(root / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _base_package(module: str, is_package: bool, level: int) -> str:
    """The package a ``from`` import with ``level`` leading dots is relative to."""
    parts = module.split(".")
    keep = len(parts) - level + (1 if is_package else 0)
    if keep <= 0:
        raise ValueError(f"{module}: relative import beyond the top-level package (level {level})")
    return ".".join(parts[:keep])


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` (the file ``path``) imports, resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):  # every nesting level: functions, classes, if TYPE_CHECKING, try
        if isinstance(node, ast.Import):
            found.update(_nearest_known(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _base_package(module, is_package, node.level)
                base = f"{pkg}.{base}" if base else pkg
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else _nearest_known(base, known))
    found.discard(None)
    found.discard(module)
    return found


def _nearest_known(name: str, known: set[str]) -> str | None:
    """``name`` or its longest prefix that is a module of the project (None: a third-party module)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    files = module_files(root, packages)
    known = set(files)
    return {m: imports_of(m, p, known) for m, p in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) for every strongly connected component of more than one module
    (Tarjan's algorithm, iterative so that deep graphs do not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_cycle_in(graph, c) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first within the component)."""
    start = min(component)
    parents = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
                if child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle in the strongly connected component {sorted(component)}")


def _within(module: str, prefixes) -> bool:
    parts = module.split(".")
    return any(
        len(parts) >= len(p.split(".")) and all(q in ("*", m) for q, m in zip(p.split("."), parts)) for p in prefixes
    )


def forbidden_edges(graph: dict[str, set[str]], rules=FORBIDDEN) -> list[str]:
    """One line per import that breaks a rule: ``importer -> imported: why``."""
    bad = []
    for importer in sorted(graph):
        for imported in sorted(graph[importer]):
            for sources, targets, why, *exempt in rules:
                if (
                    _within(importer, sources)
                    and _within(imported, targets)
                    and not (exempt and _within(importer, exempt[0]))
                ):
                    bad.append(f"{importer} -> {imported}: {why}")
    return bad


# ------------------------------------------------------------------------------------- the rules
def test_the_scan_sees_the_whole_package():
    graph = import_graph()
    assert {
        "asyncrl.commands.cli",
        "asyncrl.actor.actor",
        "asyncrl.learner.training.trainer",
        "asyncrl.rollout.workflow",
        "asyncrl.app.main",
    } <= set(graph)
    # imports inside functions and relative imports are followed (make_engine imports .hf lazily)
    assert "asyncrl.engine.hf" in graph["asyncrl.engine"]
    assert "asyncrl.config" in graph["asyncrl.engine"]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles between modules:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_no_forbidden_import_directions():
    bad = forbidden_edges(import_graph()) + ground_floor_edges(import_graph())
    assert not bad, "imports in a forbidden direction (importer -> imported):\n" + "\n".join("  " + b for b in bad)


# ----------------------------------------------------------------- the checker itself can fail
def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_reports_a_cycle_and_a_forbidden_edge(tmp_path):
    """A small tree with a cycle through a function-level relative import and an actor-side module
    importing the learner: both are reported by name."""
    _write(
        tmp_path,
        {
            "asyncrl/__init__.py": "",
            "asyncrl/config.py": "import numpy\n",
            "asyncrl/actor/__init__.py": "",
            "asyncrl/actor/actor.py": "from ..rollout import loop\n",
            "asyncrl/rollout/__init__.py": "",
            "asyncrl/rollout/loop.py": "def f():\n    from ..actor.actor import x\n",
            "asyncrl/envs/__init__.py": "",
            "asyncrl/envs/base.py": "from asyncrl.learner.ingest.buffer import EpisodeQueue\nfrom .. import config\n",
            "asyncrl/learner/__init__.py": "",
            "asyncrl/learner/ingest/buffer.py": "from asyncrl import config\n",
            "app/__init__.py": "",
            "app/main.py": "import asyncrl.commands.cli\n",
        },
    )
    graph = import_graph(tmp_path)
    assert graph["asyncrl.envs.base"] == {"asyncrl.learner.ingest.buffer", "asyncrl.config"}
    assert graph["asyncrl.app.main"] == {"asyncrl"}  # no asyncrl/commands/cli.py in this tree: its package is what runs
    assert find_cycles(graph) == [["asyncrl.actor.actor", "asyncrl.rollout.loop", "asyncrl.actor.actor"]]
    assert forbidden_edges(graph) == [
        "asyncrl.envs.base -> asyncrl.learner.ingest.buffer: code that runs on an actor never imports the learner"
    ]
    assert ground_floor_edges({"asyncrl.rundir.layout": {"asyncrl.types", "asyncrl.config"}}) == [
        "asyncrl.rundir.layout -> asyncrl.config: the ground floor imports only the ground floor"
    ]


def test_weight_transports_declare_what_the_learner_calls():
    """The sync Protocols name every call (``needs_snapshot``, ``frames``, ``poll``, ``close``;
    ``tensors``, ``close``): each transport has them, and the learner probes none with getattr."""
    from asyncrl.weights import TRANSPORTS

    for name, (publisher, receiver) in TRANSPORTS.items():
        assert all(callable(getattr(publisher, m, None)) for m in ("frames", "poll", "close")), name
        assert isinstance(publisher.needs_snapshot, bool), name
        assert all(callable(getattr(receiver, m, None)) for m in ("tensors", "close")), name
    assert "getattr(self.weights_out" not in (ROOT / "asyncrl" / "learner" / "learner.py").read_text()


def test_every_name_table_is_a_registry_with_the_import_path_fallback():
    from asyncrl.algos.absolute_zero.domains import DOMAINS
    from asyncrl.config import ConfigError
    from asyncrl.engine import ENGINES
    from asyncrl.envs.base import ENVS, REWARDS
    from asyncrl.models.tiny import BUILTIN_FORMATS
    from asyncrl.objectives.advantages import ADV_ESTIMATORS
    from asyncrl.objectives.corrections import OFF_POLICY_CORRECTIONS
    from asyncrl.objectives.losses import POLICY_LOSSES
    from asyncrl.registry import Registry
    from asyncrl.rollout.workflow import WORKFLOWS, workflow_class
    from asyncrl.weights import TRANSPORTS

    workflow_class("grpo")  # (the built-in algorithms register on first use)
    tables = (
        WORKFLOWS,
        ENGINES,
        TRANSPORTS,
        ENVS,
        REWARDS,
        DOMAINS,
        BUILTIN_FORMATS,
        ADV_ESTIMATORS,
        POLICY_LOSSES,
        OFF_POLICY_CORRECTIONS,
    )
    assert all(isinstance(t, Registry) for t in tables)
    assert REWARDS.resolve("exact_match", "env.reward") is REWARDS["exact_match"]
    assert REWARDS.resolve("tests.support.plugins:short_reply_reward", "env.reward").__name__ == "short_reply_reward"
    assert ENVS.resolve("calculator", "env.type").__name__ == "CalculatorEnv"  # a lazily imported built-in
    try:
        REWARDS.resolve("nope", "env.reward", what="function")
    except ConfigError as e:
        assert str(e) == (
            "env.reward: unknown reward 'nope'; built-in: arithmetic, exact_match, last_number, reasoning_gym, or "
            "an import path 'pkg.module:function'"
        )
    else:
        raise AssertionError("an unknown name was accepted")


# ------------------------------------------------------------------- one data model, one module
def field_name_lists(root: Path, names: set[str], home: str = "asyncrl.types", least: int = 3) -> list[str]:
    """Places outside ``home`` that spell ``least`` or more of ``names`` in one literal (a tuple,
    list, set or dict's keys): a hand-written copy of the data model's fields."""
    bad = []
    for module, path in module_files(root).items():
        if module == home or _within(
            module, ("asyncrl.testing",)
        ):  # (a hostile peer writes the wire by hand, on purpose)
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            elts = (
                [k for k in node.keys if k is not None]
                if isinstance(node, ast.Dict)
                else node.elts
                if isinstance(node, (ast.List, ast.Tuple, ast.Set))
                else []
            )
            hits = [e.value for e in elts if isinstance(e, ast.Constant) and e.value in names]
            if len(hits) >= least:
                bad.append(f"{module}:{node.lineno} spells Trajectory fields {hits}")
    return bad


def test_trajectory_field_names_are_written_in_one_module():
    """Adding a field to Trajectory is a change to asyncrl/types.py: the wire's columns and frames,
    the run log's summaries and the decoders are generated from its fields."""
    from asyncrl.types import PER_TOKEN, Trajectory
    from asyncrl.wire.messages import Columns

    names = set(Trajectory.__struct_fields__)
    assert not (bad := field_name_lists(ROOT, names)), "\n".join(bad)
    per_token = {name for name, _, _ in PER_TOKEN}
    assert names == (set(Columns.__struct_fields__) | per_token) - {"length"} - {f"has_{n}" for n in per_token}


def test_the_field_check_finds_a_hand_written_copy(tmp_path):
    _write(
        tmp_path,
        {
            "asyncrl/__init__.py": "",
            "asyncrl/types.py": "F = ('reward', 'text', 'id')\n",
            "asyncrl/wire/codec.py": "COLS = ['reward', 'text', 'id', 'other']\nx = {'reward': 1}\n",
            "app/__init__.py": "",
        },
    )
    assert field_name_lists(tmp_path, {"reward", "text", "id"}) == [
        "asyncrl.wire.codec:1 spells Trajectory fields ['reward', 'text', 'id']"
    ]


def test_an_algorithm_tab_may_read_the_ui_kit_and_nothing_names_an_algorithm():
    graph = {
        "asyncrl.algos.rlcr.ui": {"asyncrl.app.kit", "asyncrl.analysis"},  # its UI tab: allowed
        "asyncrl.algos.rlcr.trees": {"asyncrl.app.kit"},  # the algorithm itself: not
        "asyncrl.app.main": {"asyncrl.algos.rlcr.ui"},  # the app names the tab: not
        "asyncrl.learner.learner": {"asyncrl.algos.absolute_zero.workflow"},  # the learner names one: not
        "asyncrl.analysis.store": {"asyncrl.rollout.workflow"},
    }  # through the registry: allowed
    assert forbidden_edges(graph) == [
        "asyncrl.algos.rlcr.trees -> asyncrl.app.kit: algorithms sit below the run analysis and the UI that read their records "
        "(but for their UI tab)",
        "asyncrl.app.main -> asyncrl.algos.rlcr.ui: the generic layers name no algorithm: an algorithm registers its tables, "
        "views and trained-sample filter with its workflow",
        "asyncrl.app.main -> asyncrl.algos.rlcr.ui: an algorithm's UI tab is loaded by the UI by its import path (Workflow.views)",
        "asyncrl.learner.learner -> asyncrl.algos.absolute_zero.workflow: the generic layers name no algorithm: an "
        "algorithm registers its tables, views and trained-sample filter with its workflow",
    ]


# --------------------------------------------------------------------------------- floors of the house
# The package's rooms from the ground up: a module may import its own room and the rooms of lower
# floors, never a room of its own floor or above (docs/design/architecture.md, "Module map"). A room is a
# top-level package or module of asyncrl (``asyncrl.app``, the app/ folder, is one room; an algorithm's UI tab is a room of its own).
FLOORS = [
    ("asyncrl.types", "asyncrl.config", "asyncrl.lifecycle", "asyncrl.metric_names", "asyncrl.timeline"),
    ("asyncrl.plugins", "asyncrl.wire", "asyncrl.prompts", "asyncrl.sandbox"),
    ("asyncrl.registry", "asyncrl.rundir"),
    ("asyncrl.schedulers", "asyncrl.weights", "asyncrl.objectives"),
    ("asyncrl.engine",),
    ("asyncrl.endpoint",),
    ("asyncrl.envs",),
    ("asyncrl.models",),
    ("asyncrl.rollout",),
    ("asyncrl.algos",),
    ("asyncrl.analysis",),
    ("asyncrl.actor", "asyncrl.learner"),
    ("asyncrl.app",),
    ALGO_UI,
    ("asyncrl.commands",),
    ("asyncrl.testing",),  # the harnesses of the tests and benchmarks may use anything; nothing uses them
    ("asyncrl.__main__",),
]
# Inside the learner: training may use ingest's staleness policy, ingest knows nothing of training, and
# neither reaches back up into the learner's own modules (the loop, start-up, checkpoints, hooks).
LEARNER_FLOORS = [("asyncrl.learner.ingest",), ("asyncrl.learner.training",), ("asyncrl.learner.*",)]
MAX_ROOT_MODULES = 10  # files directly under asyncrl/ (foundations and the package's entry points)


def _floor_of(module: str, floors) -> int | None:
    """The floor of ``module``'s room (the most specific prefix wins: an algorithm's UI tab over asyncrl.algos)."""
    best = None
    for i, rooms in enumerate(floors):
        for prefix in rooms:
            if _within(module, (prefix,)) and (best is None or len(prefix.split(".")) > best[1]):
                best = (i, len(prefix.split(".")))
    return None if best is None else best[0]


def _room_of(module: str, floors) -> str | None:
    found = [p for rooms in floors for p in rooms if _within(module, (p,))]
    return max(found, key=lambda p: len(p.split(".")), default=None)


def unplaced(graph: dict[str, set[str]], floors=FLOORS) -> list[str]:
    """The modules on no floor (the package's own ``__init__`` aside)."""
    return [
        f"{m}: on no floor (add its room to FLOORS)"
        for m in sorted(graph)
        if m not in PACKAGES and _floor_of(m, floors) is None
    ]


def floor_violations(graph: dict[str, set[str]], floors=FLOORS) -> list[str]:
    """One line per import from a room to a room of its own floor or a higher one."""
    bad = []
    for importer in sorted(graph):
        fi, ri = _floor_of(importer, floors), _room_of(importer, floors)
        for imported in sorted(graph[importer]):
            fj, rj = _floor_of(imported, floors), _room_of(imported, floors)
            if None in (fi, fj) or ri == rj or fj < fi:
                continue
            where = "its own floor" if fj == fi else "a higher floor"
            bad.append(
                f"{importer} -> {imported}: an import of a room on {where} ({rj}, floor {fj + 1}; "
                f"{ri} is on floor {fi + 1})"
            )
    return bad


def string_registrations(root: Path = ROOT) -> list[tuple[str, str, int]]:
    """``(registering module, registered import path, line)`` for every built-in that a Registry holds by
    import path (``Registry(kind, {name: "pkg.module:Name"})`` or ``.add(name, "pkg.module:Name")``)."""
    out = []
    for module, path in module_files(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            values = []
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Registry":
                values = [v for a in node.args[1:2] if isinstance(a, ast.Dict) for v in a.values]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add" and len(node.args) == 2:
                values = [node.args[1]]
            out += [
                (module, v.value, v.lineno)
                for v in values
                if isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value.startswith(tuple(PACKAGES))
            ]
    return out


def foreign_string_registrations(root: Path = ROOT) -> list[str]:
    """A built-in registered by import path lives in the registering module's own room: a string is no
    way around the floors (it would be an import from a lower room up to a higher one)."""
    return [
        f"{module}:{line} registers {target!r}, outside its room {_room_of(module, FLOORS)}"
        for module, target, line in string_registrations(root)
        if _room_of(target.split(":")[0], FLOORS) != _room_of(module, FLOORS)
    ]


# A function's size in statements (its docstring aside; nested ones count with it): what the formatter
# does with line breaks does not change it. 45 statements is what sixty lines held before the code was
# formatted with ruff.
MAX_FUNCTION_STATEMENTS = 45
# The spines: functions that read top to bottom as the one place where a path of the system is told,
# allowed past the limit because cutting them into helpers would scatter that story over files.
SPINES = {
    ("asyncrl.learner.training.trainer", "step"): "the learner's training step: critic, proximal pass, "
    "each mini-batch's micro-batches, update and statistics (PolicyTrainer.step)",
    ("asyncrl.learner.learner", "train_on"): "one step of the learner: hooks, archive, batch, the step, "
    "version, publish, metrics (Learner.train_on)",
    ("asyncrl.learner.learner", "_run"): "the learner's loop: pump, take, train, checkpoint, then the stop "
    "and the summary (Learner._run)",
}
MAX_SPINE_STATEMENTS = 120  # a spine is still one sitting's reading


def statements(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = (
        node.body[1:]
        if node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
        else node.body
    )
    return sum(1 for top in body for x in ast.walk(top) if isinstance(x, ast.stmt))


def long_functions(root: Path = ROOT, limit: int = MAX_FUNCTION_STATEMENTS, spines=SPINES) -> list[str]:
    out = []
    for module, path in module_files(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                most = MAX_SPINE_STATEMENTS if (module, node.name) in spines else limit
                if (n := statements(node)) > most:
                    out.append(f"{module}:{node.lineno} {node.name}: {n} statements (at most {most})")
    return out


def root_modules(root: Path = ROOT) -> list[str]:
    return sorted(p.name for p in (root / "asyncrl").glob("*.py") if p.name != "__init__.py")


def test_every_room_imports_only_lower_floors():
    graph = import_graph()
    bad = (
        unplaced(graph)
        + floor_violations(graph)
        + floor_violations({m: deps for m, deps in graph.items() if _within(m, ("asyncrl.learner",))}, LEARNER_FLOORS)
    )
    assert not bad, "imports against the floors:\n" + "\n".join("  " + b for b in bad)


def test_built_ins_registered_by_import_path_stay_in_their_room():
    regs = string_registrations()
    assert ("asyncrl.schedulers", "asyncrl.schedulers.local:launch") in [
        (m, t) for m, t, _ in regs
    ]  # (the scan sees them)
    assert not (bad := foreign_string_registrations()), "\n".join(bad)


def test_no_function_is_longer_than_its_limit():
    assert not (bad := long_functions()), "\n".join(bad)


def test_the_package_root_holds_only_foundations():
    names = root_modules()
    assert len(names) <= MAX_ROOT_MODULES, names


def test_the_new_rules_fail_on_a_tree_that_breaks_them(tmp_path):
    """Each of the rules above reports a tree built to break it (the tree before issue 43 broke each
    of them: an environment reaching up into the rollout package, a string registration from envs into
    rollout, 18 modules at the root, a 175-line function)."""
    _write(
        tmp_path,
        {
            "asyncrl/__init__.py": "",
            "app/__init__.py": "",
            "asyncrl/types.py": "",
            "asyncrl/envs/__init__.py": "",
            "asyncrl/envs/tasks.py": "def f():\n    from ..rollout.verifiers_env import x\n",
            "asyncrl/envs/base.py": "ENVS = Registry('environment', {'agent': 'asyncrl.rollout.agent:AgentEnv'})\n",
            "asyncrl/rollout/__init__.py": "",
            "asyncrl/rollout/verifiers_env.py": "from ..envs import tasks\n",
            "asyncrl/rollout/agent.py": "def g():\n" + "    x = 1\n" * 61,
            **{f"asyncrl/m{i}.py": "" for i in range(10)},
        },
    )
    graph = import_graph(tmp_path)
    assert floor_violations(graph) == [
        "asyncrl.envs.tasks -> asyncrl.rollout.verifiers_env: an import of a room on a higher floor "
        "(asyncrl.rollout, floor 9; asyncrl.envs is on floor 7)"
    ]
    assert foreign_string_registrations(tmp_path) == [
        "asyncrl.envs.base:1 registers 'asyncrl.rollout.agent:AgentEnv', outside its room asyncrl.envs"
    ]
    assert long_functions(tmp_path) == ["asyncrl.rollout.agent:1 g: 61 statements (at most 45)"]
    assert len(root_modules(tmp_path)) == 11 > MAX_ROOT_MODULES


def test_a_config_field_that_names_a_registry_entry_defaults_to_a_registered_name():
    """``asyncrl.config.registered`` fields: the registry is the one declaration of their names; the
    config checks every other value against it, and its default is registered (or null: none)."""
    import importlib

    from pydantic import BaseModel

    from asyncrl.config import Config

    seen, todo = [], [("", Config)]
    while todo:
        prefix, model = todo.pop()
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                todo.append((f"{prefix}{name}.", ann))
            extra = field.json_schema_extra
            if isinstance(extra, dict) and "registry" in extra:
                module, _, table = extra["registry"].partition(":")
                registry = getattr(importlib.import_module(module), table)
                assert field.default is None or field.default in registry, (
                    f"{prefix}{name}: default {field.default!r} is not in {extra['registry']}"
                )
                seen.append(f"{prefix}{name}")
    assert {
        "engine.type",
        "sync.type",
        "launch.scheduler",
        "tasks.type",
        "env.type",
        "env.reward",
        "train.policy_loss",
        "train.off_policy_correction",
        "train.advantage.estimator",
    } <= set(seen), seen
