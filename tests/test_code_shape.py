"""benchmarks/code_shape.py, which the closing notes' sizes come from: it finds a class over 300 lines and a
function over 60 in a tree, not through the stratamesh/ links, and counts the Deployer's one-statement methods."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("code_shape", ROOT / "benchmarks" / "code_shape.py")
code_shape = importlib.util.module_from_spec(spec)
spec.loader.exec_module(code_shape)

DEPLOYER = '''
class Deployer:
    def __init__(self):
        self.a = 1
        self.b = 2

    def route(self):
        """A delegation."""
        return self.a
'''


def test_big_classes_and_functions_and_the_deployers_delegations_are_found(tmp_path: Path) -> None:
    (tmp_path / "coordinator" / "control").mkdir(parents=True)
    (tmp_path / "coordinator" / "control" / "deployer.py").write_text(DEPLOYER)
    body = "".join(f"        x = {i}\n" for i in range(299))
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "big.py").write_text(f"class Big:\n    def f(self):\n{body}\n\ndef small():\n    pass\n"
                                               f"\n\ndef long():\n" + "".join(f"    y = {i}\n" for i in range(60)))
    (tmp_path / "stratamesh").mkdir()
    (tmp_path / "stratamesh" / "agent").symlink_to(Path("..", "agent"))     # read once, not twice
    classes, functions, methods, one_statement = code_shape.shape(tmp_path)
    assert classes == [(301, "agent/big.py Big")]
    assert functions == [(300, "agent/big.py f"), (61, "agent/big.py long")]
    assert (methods, one_statement) == (["__init__", "route"], 1)
