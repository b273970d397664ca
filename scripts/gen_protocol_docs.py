"""Regenerate the message field tables in docs/protocol.md from dtrain/api/messages.py.

Each table sits between ``<!-- fields:TypeName -->`` and ``<!-- /fields -->``; the prose
around it is hand-written and left alone.

    python scripts/gen_protocol_docs.py          # rewrite the tables
    python scripts/gen_protocol_docs.py --check  # exit 1 if any table is stale
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dtrain.api.messages import message_types  # noqa: E402
from scripts.docgen import check_flag, write_or_check  # noqa: E402

DOC = ROOT / "docs" / "protocol.md"
BLOCK = re.compile(r"(<!-- fields:(\w+) -->\n)(.*?)(<!-- /fields -->)", re.S)


def table(name: str) -> str:
    message = message_types()[name]
    rows = ["| field | type | presence | meaning |", "|---|---|---|---|"]
    for spec in message.specs():
        presence = "optional" if spec.optional else ("required, may be null" if spec.nullable else "required")
        rule = spec.rule.describe().replace("|", "\\|")
        rows.append(f"| `{spec.name}` | {rule} | {presence} | {spec.doc.replace('|', chr(92) + '|')} |")
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    known = message_types()

    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in known:
            raise SystemExit(f"docs/protocol.md names unknown message {name!r}")
        return match.group(1) + table(name) + match.group(4)

    return BLOCK.sub(replace, text)


def documented(text: str) -> list[str]:
    return [m.group(2) for m in BLOCK.finditer(text)]


def main() -> int:
    check = check_flag()
    fresh = render(DOC.read_text())
    return write_or_check(DOC, fresh, check=check, what="field tables are",
                          note=f" ({len(documented(fresh))} tables)")


if __name__ == "__main__":
    raise SystemExit(main())
