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

ROW = re.compile(r"^\s+(\S+)\s+(\S+(?: \S+)*)\s+lines\s+(\d+)-(\d+)\s+(\d+)$")


def lines_of(root, name):
    with open(os.path.join(root, name), encoding="utf-8") as f:
        return f.read().splitlines()


def run(*args):
    """The two tables the script prints: [[(file, what, first, last, n)]], [total]."""
    r = subprocess.run([sys.executable, "scripts/reading_path.py", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    tables, totals = [], []
    for line in r.stdout.splitlines():
        if not line.startswith(" "):
            tables.append([])
        elif m := ROW.match(line):
            f, what, a, b, n = m.groups()
            tables[-1].append((f, what, int(a), int(b), int(n)))
        elif line.split()[0] == "total":
            totals.append(int(line.split()[1]))
    return tables, totals


def test_the_counts_match_the_files():
    (walk, algo), totals = run()
    assert totals == [sum(r[-1] for r in walk), sum(r[-1] for r in algo)]
    assert walk[0][:2] == ("README.md", "One GRPO step")
    readme = lines_of(ROOT, "README.md")
    first, last = walk[0][2:4]
    assert readme[first - 1] == "## One GRPO step" and (last == len(readme) or
                                                        readme[last].startswith("## "))
    for name, what, first, last, n in walk[1:]:  # each named definition, from its first line
        assert n == last - first + 1 > 0
        head = lines_of(ROOT, name)[first - 1].strip()
        word = what.split(".")[-1]
        assert re.match(rf"(def|class) {word}\b|{word}\s*=", head), (name, what, head)
        assert f"`{what}`" in "\n".join(readme[walk[0][2] - 1:walk[0][3]])
    assert len({(r[0], r[2]) for r in walk}) == len(walk), "each definition counted once"
    assert set(reading_path.ROLES) <= {r[0] for r in algo}
    for name, what, first, last, n in algo:
        lines = lines_of(ROOT, name)
        assert n == last - first + 1 > 0 and last <= len(lines)
        markers = [i for i, x in enumerate(lines) if x.lstrip().startswith("# ---- ALGO")]
        if not markers:  # read whole
            assert (first, last) == (1, len(lines))
            continue
        assert first == markers[0] + 1, "the path starts at the first ALGO marker"
        assert not [x for x in lines[first - 1:last] if x.lstrip().startswith("# ---- SUPPORT")]
        assert last == len(lines) or lines[last].lstrip().startswith("# ---- SUPPORT")


def test_the_walk_stays_under_the_limit():
    """README.md says one step reads in about 600 lines; this catches a drift well past it."""
    parts, _ = reading_path.walk()
    total = sum(n for *_, n in parts)
    assert total <= reading_path.LIMIT, (f"the walk is {total} lines, over "
                                         f"{reading_path.LIMIT}: cut, or name less", parts)


def test_hand_counted_repository(tmp_path):
    """A repository small enough to count by hand: markers at any indentation, a file without
    markers read whole, a non-role module on the path by its ALGO marker, support modules not;
    the walk's names as module.name, Class.method, module.Class.method and a bare function."""
    files = {
        "README.md": "# t\n## One GRPO step\n`Replica.step`, `sync.pull` and `f`,\n"
                     "`sync.Cache.get`, `GET /x`, `Replica.step` again\n## Files\nc\n",  # 2-4
        "rollout.py": "import x\n# ---- ALGO: 1\nclass Replica:\n    def step(self):\n"
                      "        return 1\n    # ---- SUPPORT: z\nw = 2\n",  # 2-5
        "proxy.py": "# ---- ALGO\na = 1\n# ---- ALGO, 2\nb = 2\n",  # 1-4: no SUPPORT marker
        "trainer.py": "d = 0\n# ---- ALGO\ndef f():\n    pass\n# ---- SUPPORT\n",  # 2-4
        "grpo_loss.py": "a = 1\nb = 2\nc = 3\n",  # 1-3: no markers
        "sync.py": "# ---- ALGO\n# ---- SUPPORT\ndef pull():\n    return 1\n\n\n"
                   "class Cache:\n    def get(self):\n        pass\n",  # 1-1
        "engines.py": "q = 1\n# ---- ALGO: sampling\nr = 2\ns = 3\n",  # 2-4: by its marker
        "proxy_server.py": "support = 1\n",  # not on the path
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    got = [(f, a, b, n) for f, _, a, b, n in reading_path.reading_path(str(tmp_path))]
    assert got == [("rollout.py", 2, 5, 4), ("proxy.py", 1, 4, 4), ("trainer.py", 2, 4, 3),
                   ("grpo_loss.py", 1, 3, 3), ("sync.py", 1, 1, 1), ("engines.py", 2, 4, 3)]
    walk, other = reading_path.walk(str(tmp_path))
    assert [(f, w, a, b) for f, w, a, b, _ in walk] == [
        ("README.md", "One GRPO step", 2, 4), ("rollout.py", "Replica.step", 4, 5),
        ("sync.py", "sync.pull", 3, 4), ("trainer.py", "f", 3, 4),
        ("sync.py", "sync.Cache.get", 8, 9)]
    assert other == []  # `GET /x` is not a name
    tables, totals = run("--root", str(tmp_path))
    assert tables[0] == walk and totals == [11, 18]
