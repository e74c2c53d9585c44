"""What a newcomer following README.md and docs/client.md as written needs to find there: how to
install weightwire (from a checkout: it is on no package index), where the ``weightwire`` command is
after ``make``, what ``make test`` costs, imports only from the public packages, and a description
of every name the docs' own flows use."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CLIENT = (ROOT / "docs" / "client.md").read_text()


def _code(text: str) -> str:
    return "\n".join(re.findall(r"```(?:python|bash)?\n(.*?)```", text, flags=re.S))


def test_installing_from_a_package_index_is_not_suggested() -> None:
    for name, text in (("README.md", README), ("docs/client.md", CLIENT)):
        assert not re.search(r"pip install \"?weightwire\b", text), name
    assert 'pip install "/path/to/weightwire[sglang]"' in README


def test_the_command_is_found_after_make() -> None:
    assert ".venv/bin/weightwire" in README and "source .venv/bin/activate" in README
    assert ".venv/bin/weightwire" in CLIENT


def test_the_cost_of_make_test_is_stated() -> None:
    section = README[README.index("## Quickstart") : README.index("## Pushing weights from a trainer")]
    assert "15 minutes of installs" in section and "7.8 GB" in section and "49 minutes" in section


def test_the_readme_code_imports_only_public_packages() -> None:
    imports = re.findall(r"from (weightwire\.[\w.]+) import", _code(README))
    assert imports and not [m for m in imports if m.startswith("weightwire.core")], imports


def test_the_names_the_flows_use_are_described() -> None:
    for name in ("OwnedTensor.pieces", "ShardManifest.kept_bytes", "PushResult.bytes_received"):
        assert re.search(re.escape(name) + r"`? (is|\()", README), name
    assert "group_host=ADDR)` is the Python form of `--group-host`" in README
    assert "`bytes_received` (" in CLIENT
    assert "TP 1, 2, 4, 8, 16 or 32" in README  # the demo model's layouts


def test_the_example_sockets_are_names_discover_reads() -> None:
    from weightwire.adapters.endpoints import parse_worker_id

    sockets = set(re.findall(r"/(?:tmp|run)/ww/([\w-]+)\.sock", README + CLIENT))
    assert sockets
    for name in sockets:
        assert parse_worker_id(name) is not None, name
