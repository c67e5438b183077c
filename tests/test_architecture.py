"""The shape of the source tree, read from the files (no import of torchloom): its import graph has no circle,
docs/architecture.md's module table names every module under src/torchloom (and no module that is gone), no
module imports one of a higher layer than its own (the layers are the table's), and no module holds more than
500 lines of code unless its opening docstring says why.

Imports are read with `ast`, those inside functions included: an import deferred into a function still ties the
two modules together (it only moves the failure from import time to the first call).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Circles that cannot be broken yet, each as the sorted list of its modules, with the reason. Empty today: keep it
# so, and break a new circle by giving what both sides share a module of its own (as `_run_protocol` did for
# `connector` <-> `run`).
KNOWN_CYCLES: list[list[str]] = []


def _modules(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module under src/torchloom (a package is named by its __init__)."""
    found = {}
    for path in sorted((src / "torchloom").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The torchloom modules `name` imports anywhere in its file. `from package import x` counts as an import of
    the submodule `package.x` when there is one, else of the package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from . import x`, `from ..y import z`
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return {target for target in found if target in modules and target != name}


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    modules = _modules(src)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every circle lies in one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_checker_sees_a_circle_through_a_deferred_import(tmp_path):
    package = tmp_path / "torchloom"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from torchloom.b import X\n")
    (package / "b.py").write_text("X = 1\n\ndef f():\n    from torchloom import a\n")
    (package / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path)
    assert graph["torchloom.c"] == {"torchloom.a"}
    assert cycles(graph) == [["torchloom.a", "torchloom.b"]]


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    assert len(graph) > 30, sorted(graph)  # the tree was found
    found = cycles(graph)
    new = [cycle for cycle in found if cycle not in KNOWN_CYCLES]
    detail = {module: sorted(graph[module] & set(cycle)) for cycle in new for module in cycle}
    assert not new, f"import circles: {new}; edges inside them: {detail}"
    gone = [cycle for cycle in KNOWN_CYCLES if cycle not in found]
    assert not gone, f"these circles are broken now: remove them from KNOWN_CYCLES: {gone}"


PAGE = SRC.parent / "docs" / "architecture.md"
ROW = re.compile(r"^\|\s*`(torchloom(?:\.\w+)*)`\s*\|\s*(\d+)\s*\|")


def page_layers(text: str) -> dict[str, int]:
    """Module -> layer, from the rows of the page's module table (`| `torchloom.x` | 3 | ... |`)."""
    return {m.group(1): int(m.group(2)) for line in text.splitlines() if (m := ROW.match(line))}


def layer_violations(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    return sorted(
        f"{source} (layer {layers[source]}) imports {target} (layer {layers[target]})"
        for source, targets in graph.items()
        for target in targets
        if source in layers and target in layers and layers[target] > layers[source]
    )


def test_the_architecture_page_names_every_module_and_only_those():
    named = page_layers(PAGE.read_text())
    modules = set(_modules())
    assert not sorted(modules - set(named)), (
        f"modules missing from the table of docs/architecture.md: {sorted(modules - set(named))}"
    )
    assert not sorted(set(named) - modules), (
        f"docs/architecture.md names modules that do not exist: {sorted(set(named) - modules)}"
    )


def test_no_import_runs_from_a_lower_layer_up():
    violations = layer_violations(import_graph(), page_layers(PAGE.read_text()))
    assert not violations, "imports against the layers of docs/architecture.md:\n" + "\n".join(violations)


def test_the_layer_check_sees_an_upward_import():
    graph = {"torchloom.errors": {"torchloom.loom"}, "torchloom.loom": {"torchloom.errors"}}
    table = "| `torchloom.errors` | 0 | exceptions |\n| `torchloom.loom` | 6 | the facade |\n"
    assert layer_violations(graph, page_layers(table)) == [
        "torchloom.errors (layer 0) imports torchloom.loom (layer 6)"
    ]


# The size rule: a module holds at most this many lines of code (docstrings, comments and blank lines not counted),
# unless its opening docstring has a sentence starting "Larger than 500 lines because" that gives the reason.
MAX_CODE_LINES = 500
ALLOWED_LARGER = re.compile(r"(?:^|[.!?]\s+)Larger than 500 lines because\b")


def code_lines(source: str) -> int:
    """The lines holding code: every line a token other than a comment or a line break touches, less the lines
    of docstrings (of the module, its classes and functions)."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skipped = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def says_why_larger(source: str) -> bool:
    doc = ast.get_docstring(ast.parse(source)) or ""
    return bool(ALLOWED_LARGER.search(" ".join(doc.split())))


def oversized(src: Path = SRC) -> dict[str, int]:
    """Module -> its lines of code, for each module over the limit whose docstring does not say why."""
    found = {}
    for name, path in _modules(src).items():
        source = path.read_text()
        lines = code_lines(source)
        if lines > MAX_CODE_LINES and not says_why_larger(source):
            found[name] = lines
    return found


def test_the_line_counter_skips_docstrings_comments_and_blank_lines():
    source = '''"""Module docstring,
over two lines."""

# a comment
import os  # trailing comment


class A:
    """Class docstring."""

    x = (
        1,
        2,
    )

    def f(self):
        """One."""
        return """a string
that is not a docstring"""
'''
    # import, class, x = ( 1, 2, ), def, return and its string's second line.
    assert code_lines(source) == 1 + 1 + 4 + 1 + 2


def test_the_size_rule_sees_a_large_module_and_its_reason(tmp_path):
    package = tmp_path / "torchloom"
    package.mkdir()
    (package / "__init__.py").write_text("")
    body = "".join(f"x{i} = {i}\n" for i in range(MAX_CODE_LINES + 1))
    (package / "big.py").write_text('"""Big."""\n' + body)
    (package / "fine.py").write_text('"""A table. Larger than 500 lines because it is data."""\n' + body)
    (package / "small.py").write_text('"""Small."""\n' + body.split("\n", 1)[1])
    assert oversized(tmp_path) == {"torchloom.big": MAX_CODE_LINES + 1}


def test_no_module_is_larger_than_500_lines_of_code_without_a_reason():
    over = oversized()
    assert not over, (
        f"modules over {MAX_CODE_LINES} lines of code: {over}. Split them by concern (see docs/architecture.md), "
        'or say why in the opening docstring: "Larger than 500 lines because ...".'
    )
