"""The conversion package reads as a straight line: no import cycle (not even one held together by imports inside
functions), and every constant it defines is defined nowhere else in the source."""

import ast
from pathlib import Path

import diff_llama

SOURCE = Path(diff_llama.__file__).parents[1]  # src/, holding diff_llama and diff_llama_cli
CONVERSION = "diff_llama.conversion"
# Imports inside a conversion function are for optional dependencies only, never for the project's own modules.
OPTIONAL_IMPORTS = {"gguf"}


def _modules() -> dict:
    """Dotted module name -> (file, whether it is a package's __init__), for every module under src/."""
    modules = {}
    for file in SOURCE.rglob("*.py"):
        parts = file.relative_to(SOURCE).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (file, is_package)
    return modules


def _imported(node, module: str, is_package: bool, modules: dict) -> set:
    """The project modules an import statement of `module` names."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    package = module if is_package else module.rpartition(".")[0]
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([node.module] if node.module else []))
    else:
        base = node.module
    names = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules}
    return names or ({base} if base in modules else set())


def _import_graph(modules: dict) -> dict:
    """module -> the project modules it imports anywhere (module level or inside a function)."""
    graph = {}
    for module, (file, is_package) in modules.items():
        graph[module] = set()
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module] |= _imported(node, module, is_package, modules)
    return graph


def _cycle_through(start: str, graph: dict) -> list | None:
    """An import path from `start` back to itself, or None."""
    paths, seen = [[start]], set()
    while paths:
        path = paths.pop()
        for nxt in sorted(graph[path[-1]]):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                paths.append(path + [nxt])
    return None


def _module_constants(file: Path) -> set:
    names = set()
    for node in ast.parse(file.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        else:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()}
    return names


def test_the_conversion_package_has_no_import_cycle():
    modules = _modules()
    graph = _import_graph(modules)
    involved = [m for m in modules if m.startswith(CONVERSION)] + ["diff_llama.model_card"]
    assert len(involved) > 8  # the walk found the package
    cycles = {module: _cycle_through(module, graph) for module in involved}
    assert {m: c for m, c in cycles.items() if c} == {}


def test_conversion_imports_project_modules_at_module_level_only():
    modules = _modules()
    for module, (file, is_package) in modules.items():
        if not module.startswith(CONVERSION) and module != "diff_llama.model_card":
            continue
        tree = ast.parse(file.read_text(encoding="utf-8"))
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top_level:
                assert not _imported(node, module, is_package, modules), (module, node.lineno)
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
                assert {name.split(".")[0] for name in names} <= OPTIONAL_IMPORTS, (module, node.lineno)


def test_each_conversion_constant_is_defined_once():
    modules = _modules()
    constants = {module: _module_constants(file) for module, (file, _) in modules.items()}
    conversion = set().union(*(names for module, names in constants.items() if module.startswith(CONVERSION)))
    assert "ATTENTION_PROJECTIONS" in conversion and "LAYER_TENSORS" in conversion
    definitions = {name: [m for m, names in constants.items() if name in names] for name in conversion}
    assert {name: where for name, where in definitions.items() if len(where) > 1} == {}
