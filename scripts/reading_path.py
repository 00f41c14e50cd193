"""How many lines a reader reads to follow one GRPO step, from prompt to reloaded adapter.

The reading path: README.md's "One GRPO step" section, then each role file's algorithm: the lines
from its first `# ---- ALGO` marker to its first `# ---- SUPPORT` marker (or the end of the file;
a file without an ALGO marker, such as grpo_loss.py, is read whole). Any other module in the
repository root with an ALGO marker is on the path too: that marker says it is part of the step.
Support code (below a SUPPORT marker, or in a support module) is not.

    python scripts/reading_path.py          # one line per part, and the total
    python -m pytest -q tests/test_reading_path.py
"""

import argparse
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the role files, in the order of the step: sample, buffer, train, the loss, publish
ROLES = ("rollout.py", "proxy.py", "trainer.py", "grpo_loss.py", "sync.py")
SECTION = "## One GRPO step"  # README.md's walk through the step
ALGO = re.compile(r"^\s*# ---- ALGO")
SUPPORT = re.compile(r"^\s*# ---- SUPPORT")
AIM, LIMIT = 600, 700  # lines: what a reader should need; what tests/test_reading_path.py allows


def section(lines, heading):
    """(first, last), 1-based and inclusive: `heading` to the line before the next ## heading."""
    first = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if first is None:
        raise SystemExit(f"reading_path.py: error: README.md has no line {heading!r}")
    last = next((i for i in range(first + 1, len(lines)) if lines[i].startswith("## ")),
                len(lines))
    return first + 1, last


def algo_part(lines):
    """(first, last), 1-based and inclusive: the first ALGO marker to the line before the first
    SUPPORT marker after it (or the end); the whole file when it has no ALGO marker."""
    first = next((i for i, line in enumerate(lines) if ALGO.match(line)), 0)
    last = next((i for i in range(first, len(lines)) if SUPPORT.match(lines[i])), len(lines))
    return first + 1, last


def reading_path(root=ROOT):
    """[(file, what, first, last, lines)]: README's section, the role files, then any other
    root module with an ALGO marker."""
    def read(name):
        with open(os.path.join(root, name), encoding="utf-8") as f:
            return f.read().splitlines()

    parts = [("README.md", "One GRPO step", *section(read("README.md"), SECTION))]
    others = sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, "*.py")))
    others = [p for p in others if p not in ROLES and any(map(ALGO.match, read(p)))]
    for name in (*ROLES, *others):
        lines = read(name)
        marked = any(map(ALGO.match, lines))
        parts.append((name, "ALGO to SUPPORT" if marked else "whole file", *algo_part(lines)))
    return [(name, what, a, b, b - a + 1) for name, what, a, b in parts]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=ROOT, help="the repository (default: this script's)")
    args = p.parse_args(argv)
    parts = reading_path(args.root)
    for name, what, first, last, n in parts:
        print(f"{name:<16} {what:<16} lines {first:>4}-{last:<4} {n:>5}")
    total = sum(n for *_, n in parts)
    print(f"{'total':<16} {'':<16} {'':<16}{total:>5}   (aim ~{AIM}; the test allows {LIMIT})")
    return parts


if __name__ == "__main__":
    main()
