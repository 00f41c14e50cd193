"""How many lines a reader reads to follow one GRPO step, from prompt to reloaded adapter.

Two counts. **The walk**: README.md's "One GRPO step" section, plus every function, method or
module-level definition it names in backticks (`Replica.step`, `grpo_loss.policy_loss`,
`proxy.GROUP`, `publish`), each counted once, found in the repository's root modules: what a
reader following the README opens. **The algorithm**: each role file's lines from its first
`# ---- ALGO` marker to its first `# ---- SUPPORT` marker (or the end of the file; a file without
an ALGO marker is read whole), plus any other root module with an ALGO marker: every function of
the step, with its edge cases. Support code (below a SUPPORT marker, or in a support module) is
in neither.

    python scripts/reading_path.py          # one line per part, and the totals
    python -m pytest -q tests/test_reading_path.py
"""

import argparse
import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the role files, in the order of the step: sample, buffer, train, the loss, publish
ROLES = ("rollout.py", "proxy.py", "trainer.py", "grpo_loss.py", "sync.py")
SECTION = "## One GRPO step"  # README.md's walk through the step
ALGO = re.compile(r"^\s*# ---- ALGO")
SUPPORT = re.compile(r"^\s*# ---- SUPPORT")
NAME = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*){0,2})`")  # `a`, `a.b` or `module.Class.b`
AIM, LIMIT = 600, 700  # lines of the walk: what a reader should need; what the test allows


def read(root, name):
    with open(os.path.join(root, name), encoding="utf-8") as f:
        return f.read().splitlines()


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


def modules(root):
    """The root modules, role files first: [name.py]."""
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, "*.py")))
    return [*[r for r in ROLES if r in names], *[n for n in names if n not in ROLES]]


def definitions(root):
    """{"module.name" and "Class.method": (file, first, last)} of every root module: top-level
    functions, classes and assignments, and methods."""
    found = {}
    for name in reversed(modules(root)):  # role files last: theirs win a shared Class.method
        tree = ast.parse("\n".join(read(root, name)))
        for node in tree.body:
            targets = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
                [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            for t in targets:
                found[f"{name[:-3]}.{t}"] = (name, node.lineno, node.end_lineno)
            for m in node.body if isinstance(node, ast.ClassDef) else []:
                if isinstance(m, ast.FunctionDef):
                    found[f"{node.name}.{m.name}"] = (name, m.lineno, m.end_lineno)
    return found


def walk(root=ROOT):
    """[(file, what, first, last, lines)]: README's section, then each definition it names (in
    the order named, each once), and the backticked names that are not code."""
    lines = read(root, "README.md")
    first, last = section(lines, SECTION)
    parts, other, seen = [("README.md", "One GRPO step", first, last)], [], set()
    found = definitions(root)
    bare = {k.split(".")[1]: v for k, v in reversed(found.items()) if k.split(".")[0] + ".py"
            in modules(root)}  # `publish`: a module-level name, role files first
    for ref in NAME.findall("\n".join(lines[first - 1:last])):
        if ref.count(".") == 2:  # module.Class.method: Class.method in that module
            module, cls, method = ref.split(".")
            hit = found.get(f"{cls}.{method}")
            hit = hit if hit and hit[0] == f"{module}.py" else None
        else:
            hit = found.get(ref) or (bare.get(ref) if "." not in ref else None)
        if hit is None:
            other += [ref] if ref not in other else []
        elif hit not in seen:
            seen.add(hit)
            parts.append((hit[0], ref, hit[1], hit[2]))
    return [(f, what, a, b, b - a + 1) for f, what, a, b in parts], other


def reading_path(root=ROOT):
    """[(file, what, first, last, lines)]: the role files' algorithm, then any other root module
    with an ALGO marker."""
    parts = []
    for name in modules(root):
        lines = read(root, name)
        marked = any(map(ALGO.match, lines))
        if name in ROLES or marked:
            parts.append((name, "ALGO to SUPPORT" if marked else "whole file", *algo_part(lines)))
    return [(name, what, a, b, b - a + 1) for name, what, a, b in parts]


def table(title, parts):
    print(title)
    for name, what, first, last, n in parts:
        print(f"  {name:<16} {what:<32} lines {first:>4}-{last:<4} {n:>5}")
    total = sum(n for *_, n in parts)
    print(f"  {'total':<16} {'':<32} {'':<16}{total:>5}")
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=ROOT, help="the repository (default: this script's)")
    args = p.parse_args(argv)
    steps, other = walk(args.root)
    total = table("the walk: README's One GRPO step and the definitions it names", steps)
    print(f"  (aim ~{AIM}, the test allows {LIMIT}; named but not code: {', '.join(other)})")
    table("the algorithm: each role file's ALGO part", reading_path(args.root))
    return total


if __name__ == "__main__":
    main()
