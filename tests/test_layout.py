"""The library's layout: a flat core and two pipeline packages, `mmrecipes.contrastive` and `mmrecipes.vlm`, that
never import each other, so a CLIP forker reads the core and the contrastive package only; `mmrecipes.vlm` by concept,
its floors `arguments` -> `rows` -> `model` -> `parallel` -> `algorithms`, each importing only from its own floor and
those below; and no module imports itself through others (an import cycle, hidden or not by a function-local import).
Checked on the import statements (every module, lazy imports inside functions included) and by importing each package
alone."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "mmrecipes"
PIPELINES = ("contrastive", "vlm")
FLOORS = ("mmrecipes.vlm.arguments", "mmrecipes.vlm.rows", "mmrecipes.vlm.model", "mmrecipes.vlm.parallel",
          "mmrecipes.vlm.algorithms")  # from the bottom up


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """The absolute names of the mmrecipes modules that `source`, the text of `module`, imports."""
    package = module if is_package else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)  # `from mmrecipes import vlm`
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] == "mmrecipes"}


def pipeline_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PIPELINES else None


def crossings() -> list[str]:
    """Each import from a module into a pipeline package other than its own (core modules: into any)."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        home = pipeline_of(module_name(path))
        imports = imported_modules(path.read_text(), module_name(path), path.name == "__init__.py")
        for imported in sorted(imports):
            if (other := pipeline_of(imported)) and other != home:
                problems.append(f"{module_name(path)} imports {imported}")
    return problems


def test_neither_pipeline_imports_the_other_and_the_core_imports_neither():
    assert {pipeline_of(module_name(path)) for path in PACKAGE.rglob("*.py")} == {None, *PIPELINES}
    assert crossings() == []


def floor_of(module: str) -> int | None:
    return next((index for index, floor in enumerate(FLOORS) if module == floor or module.startswith(floor + ".")),
                None)


def upward_imports(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Each import of a `mmrecipes.vlm` module from a floor above its own."""
    problems = []
    for module, (text, is_package) in sorted(sources.items()):
        if (floor := floor_of(module)) is None:
            continue
        for imported in sorted(imported_modules(text, module, is_package)):
            if (other := floor_of(imported)) is not None and other > floor:
                problems.append(f"{module} ({FLOORS[floor]}) imports {imported} ({FLOORS[other]})")
    return problems


def test_the_vlm_floors_import_only_downwards():
    sources = library_sources()
    assert {floor_of(module) for module in sources if module.startswith("mmrecipes.vlm.")} == set(range(len(FLOORS)))
    assert upward_imports(sources) == []
    text, is_package = sources["mmrecipes.vlm.rows.collate"]  # what the rows did: the sampler's chat_rows
    sources["mmrecipes.vlm.rows.collate"] = (text + "\n\ndef _rows():\n    from ..algorithms.sampling import x\n",
                                             is_package)
    assert upward_imports(sources) == ["mmrecipes.vlm.rows.collate (mmrecipes.vlm.rows) imports "
                                       "mmrecipes.vlm.algorithms.sampling (mmrecipes.vlm.algorithms)",
                                       "mmrecipes.vlm.rows.collate (mmrecipes.vlm.rows) imports "
                                       "mmrecipes.vlm.algorithms.sampling.x (mmrecipes.vlm.algorithms)"]


def test_the_check_sees_a_lazy_cross_import():
    lazy = "\n\ndef _peek():\n    from ..vlm.rows import collate\n"
    source = (PACKAGE / "contrastive" / "data.py").read_text() + lazy
    assert "mmrecipes.vlm.rows.collate" in imported_modules(source, "mmrecipes.contrastive.data")
    assert "mmrecipes.vlm" in imported_modules("import mmrecipes.vlm", "mmrecipes.loader")


def test_each_pipeline_imports_alone():
    """Every module of one pipeline imported in a fresh process loads no module of the other (both at once)."""
    processes = {}
    for pipeline, other in (PIPELINES, PIPELINES[::-1]):
        modules = [module_name(path) for path in sorted((PACKAGE / pipeline).rglob("*.py"))]
        code = (f"import sys\nfor name in {modules!r}:\n    __import__(name)\n"
                f"print(sorted(name for name in sys.modules if name.startswith('mmrecipes.{other}')))")
        processes[pipeline] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True)
    for pipeline, process in processes.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        assert out.strip() == "[]", (pipeline, out)


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: the mmrecipes modules it imports} of `sources` ({module: (its text, whether it is a package)})."""
    return {module: imported_modules(text, module, is_package) & set(sources) - {module}
            for module, (text, is_package) in sources.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle of `graph`, as the modules around it (found by a depth-first walk)."""
    found, done = [], set()

    def walk(module, path):
        if module in path:
            found.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for imported in sorted(graph[module]):
            walk(imported, path + [module])
        done.add(module)

    for module in sorted(graph):
        walk(module, [])
    return found


def library_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(path): (path.read_text(), path.name == "__init__.py") for path in PACKAGE.rglob("*.py")}


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph(library_sources())) == []


def test_the_check_sees_a_cycle_a_lazy_import_hides():
    """What the layout had: `arguments` imported `training` inside a function (a throwaway scheduler to check a
    name), and `training` imported `arguments` at its top."""
    sources = library_sources()
    text, is_package = sources["mmrecipes.training"]
    sources["mmrecipes.training"] = (text + "\n\ndef _args():\n    from .arguments import TrainingArgs\n", is_package)
    text, is_package = sources["mmrecipes.arguments"]
    sources["mmrecipes.arguments"] = (text + "\n\ndef _check():\n    from .training import lr_scheduler\n",
                                      is_package)
    assert ["mmrecipes.arguments", "mmrecipes.training", "mmrecipes.arguments"] in cycles(import_graph(sources))


def reached(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module `module` imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        for imported in graph[todo.pop()] - seen:
            seen.add(imported)
            todo.append(imported)
    return seen


def test_the_sampling_floor_imports_neither_rewards_nor_tools():
    """Sampling (GRPO's and distillation's) reads trajectories only: the multi-turn loop is an object of tools.py the
    sampler is given, and user code's guards live in user_code.py. Before, sampling imported trajectory, which
    imported tools, which imported rewards: distillation's sampler loaded both."""
    graph = import_graph(library_sources())
    user_modules = {"mmrecipes.vlm.algorithms.rewards", "mmrecipes.vlm.algorithms.tools"}
    for module in ("mmrecipes.vlm.algorithms.sampling", "mmrecipes.vlm.algorithms.trajectory"):
        assert not reached(graph, module) & user_modules, module
    graph["mmrecipes.vlm.algorithms.trajectory"].add("mmrecipes.vlm.algorithms.tools")  # what it did: seen
    assert "mmrecipes.vlm.algorithms.tools" in reached(graph, "mmrecipes.vlm.algorithms.sampling")


def test_library_lines_over_100_characters_are_at_most_a_tenth():
    """The library was reshaped to 100 columns (20.3% of its lines were longer); this keeps the share from
    creeping back."""
    lines = [line for path in PACKAGE.rglob("*.py") for line in path.read_text().splitlines()]
    long = sum(len(line) > 100 for line in lines)
    assert long <= len(lines) / 10, f"{long} of {len(lines)} library lines are over 100 characters"
