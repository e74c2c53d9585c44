"""The checks of a GPU run script: each outcome kept in the run's JSON and printed as PASS or FAIL.

The scripts under tests/gpu run on a lent GPU machine outside pytest, so their checks are recorded
rather than asserted: a run goes on past a failed check and reports every outcome at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


class Checks:
    def __init__(self, out: dict[str, Any], log: Callable[..., None], detail_chars: int = 400) -> None:
        self.out, self.log, self.detail_chars = out, log, detail_chars
        out.setdefault("checks", [])

    def __call__(self, ok: bool, what: str, detail: Any = None) -> bool:
        self.out["checks"].append({"ok": bool(ok), "what": what, "detail": detail})
        shown = "" if detail is None else json.dumps(detail, default=str)[: self.detail_chars]
        self.log("PASS" if ok else "FAIL", what, shown)
        return ok
