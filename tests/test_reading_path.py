"""scripts/reading_path.py: the lines a reader reads to follow one GRPO step, counted from the
files, and held under the limit README.md states.

    python -m pytest -q tests/test_reading_path.py
"""

import os
import re
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import reading_path  # noqa: E402

ROW = re.compile(r"^(\S+)\s+(.+?)\s+lines\s+(\d+)-(\d+)\s+(\d+)$")


def run(*args):
    r = subprocess.run([sys.executable, "scripts/reading_path.py", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    rows = [ROW.match(line).groups() for line in lines[:-1]]
    total = int(lines[-1].split()[1])
    return [(f, int(a), int(b), int(n)) for f, _, a, b, n in rows], total


def test_the_counts_match_the_files():
    rows, total = run()
    names = [f for f, *_ in rows]
    assert names[0] == "README.md" and set(reading_path.ROLES) <= set(names)
    for name, first, last, n in rows:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            lines = f.read().splitlines()
        assert n == last - first + 1 > 0 and last <= len(lines)
        part, after = lines[first - 1:last], lines[last:last + 1]
        if name == "README.md":  # the section, from its heading to the next one
            assert part[0] == "## One GRPO step"
            assert not [x for x in part[1:] if x.startswith("## ")]
            assert not after or after[0].startswith("## ")
            continue
        algo = [i for i, x in enumerate(lines) if x.lstrip().startswith("# ---- ALGO")]
        if not algo:  # read whole
            assert (first, last) == (1, len(lines))
            continue
        assert first == algo[0] + 1, "the path starts at the first ALGO marker"
        assert not [x for x in part if x.lstrip().startswith("# ---- SUPPORT")]
        assert not after or after[0].lstrip().startswith("# ---- SUPPORT")
    assert total == sum(n for *_, n in rows)


def test_the_reading_path_stays_under_the_limit():
    """README.md says one step reads in about 600 lines; this catches a drift well past it."""
    parts = reading_path.reading_path()
    total = sum(n for *_, n in parts)
    limit = reading_path.LIMIT
    assert total <= limit, (f"the reading path is {total} lines, over {limit}: cut, or move code "
                            "to support", parts)


def test_hand_counted_repository(tmp_path):
    """A repository small enough to count by hand: markers at any indentation, a file without
    markers read whole, a non-role module on the path by its ALGO marker, support modules not."""
    files = {
        "README.md": "# t\n## One GRPO step\na\nb\n## Files\nc\n",  # lines 2-4
        "rollout.py": "import x\n# ---- ALGO: 1\ny = 1\n    # ---- SUPPORT: z\nw = 2\n",  # 2-3
        "proxy.py": "# ---- ALGO\na\n# ---- ALGO, 2\nb\n",  # 1-4: no SUPPORT marker
        "trainer.py": "d\n# ---- ALGO\ne\n# ---- SUPPORT\n# ---- ALGO\nf\n",  # 2-3
        "grpo_loss.py": "a\nb\nc\n",  # 1-3: no markers
        "sync.py": "# ---- ALGO\n# ---- SUPPORT\n",  # 1-1
        "engines.py": "q\n# ---- ALGO: sampling\nr\ns\n",  # 2-4: named by its marker
        "proxy_server.py": "support only\n",  # not on the path
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    got = [(f, a, b, n) for f, _, a, b, n in reading_path.reading_path(str(tmp_path))]
    assert got == [("README.md", 2, 4, 3), ("rollout.py", 2, 3, 2), ("proxy.py", 1, 4, 4),
                   ("trainer.py", 2, 3, 2), ("grpo_loss.py", 1, 3, 3), ("sync.py", 1, 1, 1),
                   ("engines.py", 2, 4, 3)]
    rows, total = run("--root", str(tmp_path))
    assert rows == got and total == 18
