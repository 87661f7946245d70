"""Regenerate the Notes index table in docs/design.md from the package's sources: python tools/note_index.py"""
import re, pathlib
root = pathlib.Path(__file__).resolve().parents[1]
strict = re.compile(r'^\s*(?:#|\*|/\*|"""|r""")?\s*(?:-+\s*)?Note \[([^\]]+)\]\s*-*\s*$')
loose = re.compile(r'^\s*(?:#|\*|/\*|"""|r""")?\s*(?:-+\s*)?Note \[([^\]]+)\]:')
files = sorted(list((root / "adaptive_eager").rglob("*.py")) + [root / "adaptive_eager/_hot.c"])
rows = {}
for pat in (strict, loose):
    for f in files:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            m = pat.match(line)
            if m and m.group(1) not in rows:
                rows[m.group(1)] = f"`{f.relative_to(root / 'adaptive_eager')}:{i}`"
d = root / "docs/design.md"; s = d.read_text()
start = s.index("| Note | where |")
lines = s[start:].split("\n"); n = 0
while n < len(lines) and lines[n].startswith("|"): n += 1
table = ["| Note | where |", "|---|---|"] + [f"| [{k}] | {v} |" for k, v in sorted(rows.items(), key=lambda kv: kv[0].lower())]
d.write_text(s[:start] + "\n".join(table) + "\n" + "\n".join(lines[n:])); print(len(rows))
