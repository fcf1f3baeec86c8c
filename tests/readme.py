"""What the README tells a new user to run, read from it so that tests keep it true."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

README = Path(__file__).parent.parent / "README.md"


def readme_completion() -> dict[str, Any]:
    """The JSON body of the README's first curl call to /v1/completions (the one after the quickstart)."""
    text = README.read_text()
    call = re.search(r"curl \S+/v1/completions .*?-d '(\{.*?\})'", text, re.DOTALL)
    assert call, "the README shows no curl call to /v1/completions"
    return json.loads(call[1])


def readme_perplexity() -> float:
    """The demo model's held-out perplexity as the README states it."""
    stated = re.search(r"held-out perplexity (?:is )?([\d.]+)", README.read_text())
    assert stated, "the README states no held-out perplexity for the demo model"
    return float(stated[1])
