"""The layout's own rules (CONTRIBUTING.md): no import circle between river_hf's modules, no file over ~400 lines, no
Python line over 120 characters, argparse only in the command-line modules, no binary file in git, subpackages
importing downwards, tests using public seams."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "river_hf"
MAX_LINES = 400
MAX_LINE_LENGTH = 120
PYTHON_FOLDERS = ("river_hf", "tests", "benchmarks/scripts")


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
    paths = [path for folder in PYTHON_FOLDERS for path in PACKAGE.parent.joinpath(folder).rglob("*.py")]
    long = {str(path.relative_to(PACKAGE.parent)): n for path in paths
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert paths and not long, long


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


# ---- layers: a subpackage imports from its own and the ones below it ------------------------------------------------
RANKS = {"checks": 0, "cache_folder": 0, "kernels": 1, "loading": 1, "core": 2, "lossless": 3, "offload": 3,
         "saving": 3, "bench": 4, "cli": 5}
# The upward imports the design has, each named in CONTRIBUTING.md: build_river installs offloading and saved twins,
# generate hands lossless calls to lossless/ and pushes saved twins.
UPWARD = {("river_hf.core.build", "river_hf.offload.backbone"), ("river_hf.core.build", "river_hf.saving.twin_files"),
          ("river_hf.core.build", "river_hf.saving.twin_loading"),
          ("river_hf.core.generation", "river_hf.lossless.decode"), ("river_hf.core.generation", "river_hf.saving"),
          ("river_hf.core.generation", "river_hf.saving.twin_files")}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: river_hf/__init__.py, the public API, above everything


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(module, dep) for module, deps in graph.items() for dep in deps
            if layer_of(module) is not None and RANKS[layer_of(dep)] > RANKS[layer_of(module)]}


def test_every_subpackage_has_a_layer_and_imports_only_downwards():
    graph = import_graph()
    assert {layer_of(module) for module in graph} - {None} == set(RANKS)
    assert upward_imports(graph) == UPWARD  # a new upward import is a design change: name it here and in CONTRIBUTING
    assert not any(layer_of(dep) == "core" for module, deps in graph.items() if layer_of(module) == "kernels"
                   for dep in deps)  # the kernels know nothing of rivers


def test_the_layer_check_sees_an_upward_import():
    assert upward_imports({"river_hf.kernels.quantize": {"river_hf.core.twins"}}) == {
        ("river_hf.kernels.quantize", "river_hf.core.twins")}


def test_the_package_folder_lists_a_dozen_entries():
    entries = {path.name for path in PACKAGE.iterdir() if path.name != "__pycache__"}
    assert len(entries) <= 12, sorted(entries)


# ---- tests use public seams -------------------------------------------------------------------------------------
def private_names_reached(source: str, known: set[str]) -> list[str]:
    """The private names (`_x`, not dunders) of river_hf modules that `source` imports, reads or monkeypatches."""
    tree = ast.parse(source)
    modules = {}  # local name -> river_hf module
    reached = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("river_hf"):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in known:
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif is_private(alias.name):
                    reached.append(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            modules.update({alias.asname or alias.name: alias.name for alias in node.names if alias.name in known})

    def names_module(node) -> bool:
        dotted = ast.unparse(node)
        return dotted in modules or dotted in known

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and names_module(node.value):
            reached.append(f"{ast.unparse(node.value)}.{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and is_private(str(node.args[1].value)) and names_module(node.args[0])):
            reached.append(f"{ast.unparse(node.args[0])}.{node.args[1].value}")
    return reached


def lines_over(paths, limit: int, root: Path = PACKAGE.parent) -> dict[str, list[int]]:
    """{file relative to `root`: its line numbers longer than `limit` characters}, for the files that have any."""
    found = {}
    for path in paths:
        numbers = [n for n, line in enumerate(path.read_text().splitlines(), 1) if len(line) > limit]
        if numbers:
            found[str(path.relative_to(root))] = numbers
    return found


def test_no_python_line_over_the_length_limit():
    paths = [path for folder in PYTHON_FOLDERS for path in PACKAGE.parent.joinpath(folder).rglob("*.py")]
    assert paths and not lines_over(paths, MAX_LINE_LENGTH), lines_over(paths, MAX_LINE_LENGTH)


def test_the_line_length_check_sees_a_long_line(tmp_path):
    (tmp_path / "long.py").write_text("x = 1\ny = '" + "z" * MAX_LINE_LENGTH + "'\n")
    (tmp_path / "short.py").write_text("x = 1\n" * 3)
    assert lines_over(sorted(tmp_path.glob("*.py")), MAX_LINE_LENGTH, root=tmp_path) == {"long.py": [2]}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_test_reaches_for_a_private_name_of_a_river_hf_module():
    known = set(import_graph())
    reached = {path.name: found for path in sorted(PACKAGE.parent.joinpath("tests").glob("*.py"))
               if (found := private_names_reached(path.read_text(), known))}
    assert not reached, f"use (or add) a public seam such as kernel_choice.forget(): {reached}"


def test_the_private_name_finder_finds_each_kind():
    known = {"river_hf.kernels.choice", "river_hf.kernels"}
    source = ("from river_hf.kernels import choice as kc\nfrom river_hf.kernels.choice import _pick\n"
              "import river_hf.kernels.choice\nkc._CHOICES.clear()\nmonkeypatch.setattr(kc, '_pick', None)\n"
              "river_hf.kernels.choice._memo\nkc.forget()\nkc.__name__\nother._private")
    assert sorted(private_names_reached(source, known)) == [
        "kc._CHOICES", "kc._pick", "river_hf.kernels.choice._memo", "river_hf.kernels.choice._pick"]
