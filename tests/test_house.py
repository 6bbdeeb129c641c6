"""The layout's own rules (CONTRIBUTING.md): no import circle between river_hf's modules, no file over ~400 lines,
argparse only in the command-line modules, no binary file in git."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "river_hf"
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The river_hf modules `path` imports, at any depth of the file (imports inside functions count too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:  # `from . import x` may name a module
                if f"{base}.{alias.name}" in known:
                    found.add(f"{base}.{alias.name}")
            if base in known:
                found.add(base)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(path) for path in paths}
    return {module_name(path): imported_modules(path, known) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of imports between modules (a package's __init__ importing its own modules is not one), or None."""
    def edges(module):
        return {dep for dep in graph[module] if not module_is_parent(dep, module)}

    def module_is_parent(parent, child):
        return child.startswith(parent + ".")

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module) -> list[str] | None:
        state[module], _ = 1, stack.append(module)
        for dep in sorted(edges(module)):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[module], _ = 2, stack.pop()
        return None

    return next((cycle for module in sorted(graph) if module not in state and (cycle := visit(module))), None)


def test_no_import_circle_between_modules():
    graph = import_graph()
    assert "river_hf.core.settings" in graph["river_hf.core.generation"]  # the graph sees relative imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_file_over_the_line_limit():
    long = {str(path.relative_to(PACKAGE.parent)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_argparse_stays_in_the_command_line_modules():
    users = {module_name(path) for path in PACKAGE.rglob("*.py") if "argparse" in path.read_text()}
    assert all(name.startswith("river_hf.cli") for name in users), users


def is_binary(path: Path) -> bool:
    """git's own test: a NUL byte in the first 8000 bytes."""
    with path.open("rb") as file:
        return b"\0" in file.read(8000)


def test_no_binary_file_in_git(tmp_path):
    root = PACKAGE.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    paths = [root / name for name in tracked.decode().split("\0") if name and (root / name).is_file()]
    assert paths, "git ls-files listed nothing"
    binaries = [str(path.relative_to(root)) for path in paths if is_binary(path)]
    assert not binaries, f"binary files in git (figures are SVG; models and data are built or fetched): {binaries}"
    (tmp_path / "figure.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    assert is_binary(tmp_path / "figure.png") and not is_binary(root / "README.md")


def test_importing_river_hf_does_not_load_transformers_modeling_utils():
    """`import river_hf` (also what registers the "river" quantization method) stays light: transformers' modeling_utils
    (~0.3 s of the import on the project's CPUs) loads with the first model, or when lossless verification registers
    its attention functions (exact_rows.register), not before."""
    import sys
    script = "import sys, river_hf; print('transformers.modeling_utils' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
