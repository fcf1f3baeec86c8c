"""The shape of the code at a revision, as issue #46 measured it: classes over 300 lines, functions over 60, and the
Deployer's methods (how many are one statement: delegations).

    python benchmarks/code_shape.py [--rev REV] [--rev REV2 ...]

Each revision is read from git (`git archive`), so a past one needs no checkout; the default is the working tree.
An `ast` walk over agent/, coordinator/, fleet/, partitioner/, kernels/ and stratamesh/ (its links to those folders
not followed): a class's or function's size is end_lineno - lineno + 1.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("agent", "coordinator", "fleet", "partitioner", "kernels", "stratamesh")
BIG_CLASS, BIG_FUNCTION = 300, 60


def sources(tree: Path) -> list[Path]:
    """The .py files of the folders (rglob does not follow stratamesh/<folder>'s links: each file once)."""
    return [path for folder in FOLDERS for path in sorted((tree / folder).rglob("*.py"))]


def shape(tree: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]], list[str], int]:
    """(classes over BIG_CLASS lines, functions over BIG_FUNCTION lines, the Deployer's methods, how many of those
    are one statement)."""
    classes, functions = [], []
    for path in sources(tree):
        for node in ast.walk(ast.parse(path.read_text())):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            where = f"{path.relative_to(tree)} {getattr(node, 'name', '')}"
            if isinstance(node, ast.ClassDef) and size > BIG_CLASS:
                classes.append((size, where))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and size > BIG_FUNCTION:
                functions.append((size, where))
    deployer = next(n for n in ast.parse((tree / "coordinator/control/deployer.py").read_text()).body
                    if isinstance(n, ast.ClassDef) and n.name == "Deployer")
    methods = [f for f in deployer.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
    one_statement = sum(len([s for s in f.body if not _docstring(s)]) == 1 for f in methods)
    return sorted(classes, reverse=True), sorted(functions, reverse=True), [f.name for f in methods], one_statement


def _docstring(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)


def checked_out(rev: str, into: Path) -> Path:
    """The tree of rev, unpacked into a folder."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="tar")
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", action="append", help="a git revision (repeatable); default: the working tree")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {rev: checked_out(rev, Path(tmp, str(i))) for i, rev in enumerate(args.rev)} if args.rev else {
            "working tree": ROOT}
        for name, tree in trees.items():
            classes, functions, methods, one = shape(tree)
            print(f"## {name}\n")
            print(f"| {'classes over 300 lines':<60} | {'lines':>5} |\n|{'-' * 62}|{'-' * 7}|")
            for size, where in classes:
                print(f"| {where:<60} | {size:>5} |")
            print(f"\n| {'functions over 60 lines':<60} | {'lines':>5} |\n|{'-' * 62}|{'-' * 7}|")
            for size, where in functions:
                print(f"| {where:<60} | {size:>5} |")
            print(f"\nDeployer: {len(methods)} methods, {one} of one statement: {', '.join(methods)}\n")


if __name__ == "__main__":
    main()
