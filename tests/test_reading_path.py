"""scripts/reading_path.py: from the functions README's "One GRPO step" names, every call
followed through the repository, each function reached counted once. Small repositories written
here, counted by hand; the count the same wherever a function lives; the calls it cannot follow
said; and the script run on this repository.

    .venv/bin/python -m pytest -q tests/test_reading_path.py
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import reading_path  # noqa: E402

README = """# t
## One GRPO step
The step: `role.step`, then `q` and `GET /x`, which are not code.
```
`fenced` is left out
```
## Files
`helpers.never` is in another section.
"""
ROLE = '''from support.helpers import prepare


def step(x):
    """One step."""
    # prepare, then one more
    return prepare(x) + 1


def unused():
    return 2
'''
HELPERS = """def prepare(x):
    return scale(x)


def scale(x):

    return 2 * x


def never():
    return scale(3)
"""


def write(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text) if name.endswith(".py") else text)
    return str(root)


def counted(rep):
    """{(path, qualname): (first, last)} of what rep reached."""
    return {k: (r.func.first, r.func.last) for k, r in rep.reached.items()}


def run(*args):
    r = subprocess.run([sys.executable, "scripts/reading_path.py", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_call_of_a_call_is_counted(tmp_path):
    """role.step -> support.helpers.prepare -> scale: all three, whole (a blank line and the
    docstring and comment included in lines, left out of code); unused and never are not
    reached; README's other section and the fenced block are not read."""
    root = write(tmp_path, {"README.md": README, "role.py": ROLE, "support/__init__.py": "",
                            "support/helpers.py": HELPERS})
    rep = reading_path.reading_path(root)
    assert counted(rep) == {("role.py", "step"): (4, 7),
                            ("support/helpers.py", "prepare"): (1, 2),
                            ("support/helpers.py", "scale"): (5, 7)}
    assert [(p, k, n, c, s) for p, k, n, c, s in rep.files] == [
        ("role.py", 1, 4, 2, [(4, 7)]),
        ("support/helpers.py", 2, 5, 4, [(1, 2), (5, 7)])]
    assert (rep.lines, rep.code, rep.top_lines, rep.top_code) == (9, 6, 4, 2)
    assert rep.not_code == ["q"]
    assert rep.calls == {"repository": 2}
    out = run("--root", root)
    assert re.search(r"^role\.py\s+1\s+4\s+2$", out, re.M)
    assert re.search(r"^total\s+3\s+9\s+6$", out, re.M)
    assert re.search(r"^top level \(role files\)\s+1\s+4\s+2\s+44% of the lines, 33% of the "
                     r"code$", out, re.M)
    assert "    1-2 5-7\n" in out


MOVES = {
    "in helpers": {"support/helpers.py": HELPERS},
    "imported by name": {
        "support/helpers.py": "from support.other import scale\n\n\n" + HELPERS.split(
            "\n\n\ndef scale")[0] + "\n\n\ndef never():\n    return scale(3)\n",
        "support/other.py": "def scale(x):\n\n    return 2 * x\n"},
    "through the module": {
        "support/helpers.py": "from support import other\n\n\ndef prepare(x):\n"
                              "    return other.scale(x)\n",
        "support/other.py": "import os\n\n\ndef scale(x):\n\n    return 2 * x\n"},
    "in the role file": {
        "role.py": ROLE.replace("from support.helpers import prepare\n",
                                "def prepare(x):\n    return scale(x)\n") +
        "\n\ndef scale(x):\n\n    return 2 * x\n",
        "support/helpers.py": ""},
}


@pytest.mark.parametrize("where", MOVES)
def test_moving_a_function_does_not_change_the_count(tmp_path, where):
    """The issue's point: scale and prepare moved between files, imported by name or through
    their module, the totals stay 9 lines and 6 of code; only the split between files moves."""
    files = {"README.md": README, "role.py": ROLE, "support/__init__.py": ""}
    files.update(MOVES[where])
    rep = reading_path.reading_path(write(tmp_path, files))
    assert sorted(q for _, q in rep.reached) == ["prepare", "scale", "step"]
    assert (rep.lines, rep.code) == (9, 6)
    assert rep.top_lines == (9 if where == "in the role file" else 4)


BUFFER = '''{imports}

class Buffer({bases}):
    def __init__(self):
        self.leases = {{}}

    def quota(self, worker):
        """Step 1."""
        return self._quota(worker) + self._count()

    def _count(self):
        return len(self.leases)
{here}'''
QUOTA = '''
    def _quota(self, worker):
        # the rule
        return self._share(worker) - self._count()

    def _share(self, worker):
        return 1
'''


@pytest.mark.parametrize("mixin", [False, True])
def test_moving_a_method_into_a_mixin_does_not_change_the_count(tmp_path, mixin):
    """proxy.py's _quota moved into a mixin in support/ (what the issue saw lower the old
    count): the step reaches it through self, and _share, and Buffer._count from the mixin's
    self (a method only the subclass has)."""
    readme = README.replace("`role.step`", "`Buffer.quota`")
    if mixin:
        files = {"role.py": BUFFER.format(imports="from support.rules import Rules\n",
                                          bases="Rules", here=""),
                 "support/rules.py": "class Rules:\n    SLOW = 2\n" + QUOTA}
    else:
        files = {"role.py": BUFFER.format(imports="", bases="", here=QUOTA)}
    rep = reading_path.reading_path(write(tmp_path, {"README.md": readme, **files}))
    owner = "Rules" if mixin else "Buffer"
    assert sorted(q for _, q in rep.reached) == sorted(
        ["Buffer.quota", "Buffer._count", f"{owner}._quota", f"{owner}._share"])
    assert (rep.lines, rep.code) == (3 + 2 + 3 + 2, 2 + 2 + 2 + 2)


RESOLVE = '''import os

from support import parts
from support.parts import Base, Fast, Plain, make


class Engine(Base):
    def __init__(self, model):
        super().__init__(model)
        self.inner = Plain()

    def run(self):
        return self.inner.go()


def step(engine, callback, d):
    """engine and callback: nobody in the repository calls step, so their classes are unknown."""
    engine.go()                    # unresolved: Plain.go or Fast.go
    callback()                     # unresolved: a callable held in a variable
    d.get("k")                     # unresolved: Packs-like get of ours, or a dict's
    os.path.join("a", "b")         # a library
    len(d)                         # a builtin
    Engine(1).run()                # Engine.__init__ -> Base.__init__, Engine.run -> Plain.go
    use(make())                    # make returns Fast: use's e is a Fast -> Fast.go
    parts.helper(key=len)          # through the module
    sorted([], key=parts.order)    # a function passed by name


def use(e):
    return e.go()
'''
PARTS = '''class Base:
    def __init__(self, model):
        self.model = model


class Plain:
    def go(self):
        return 1

    def get(self, k):
        return k


class Fast:
    def go(self):
        return 2


def make():
    return Fast()


def helper(key):
    return key


def order(x):
    return x
'''


def test_what_it_resolves_and_what_it_says_it_cannot(tmp_path):
    """Each rule of the docstring once: Class(...) to __init__ and super() to the base's, self.x
    to what __init__ put there, a function's return and a parameter's type from its callers, a
    module's function, a function passed by name; a parameter nobody passes stays unknown, and
    the three calls on such are counted, listed with the methods they could reach, and bound the
    count from above."""
    root = write(tmp_path, {"README.md": README, "role.py": RESOLVE, "support/__init__.py": "",
                            "support/parts.py": PARTS})
    rep = reading_path.reading_path(root)
    assert sorted(q for _, q in rep.reached) == [
        "Base.__init__", "Engine.__init__", "Engine.run", "Fast.go", "Plain.go", "helper",
        "make", "order", "step", "use"]
    un = [(line, text, [f.qualname for f in c]) for _, line, _, text, _, c in rep.unresolved]
    assert un == [(18, "engine.go", ["Plain.go", "Fast.go"]), (19, "callback", []),
                  (20, "d.get", ["Plain.get"])]
    assert rep.calls["unresolved"] == 3
    assert rep.bound == (len(rep.reached) + 1, rep.lines + 2, rep.code + 2)  # + Plain.get
    out = run("--root", root, "--verbose")
    assert "not resolved 3 (--verbose lists them)" in out
    assert "role.py:18 engine.go(...) in step: Plain.go, Fast.go" in out
    assert "role.py:19 callback(...) in step: (a callable held in a variable)" in out
    assert re.search(r"support/parts.py:15-16 +Fast.go +2 +called at role.py:30 \(use\)", out)


def test_readme_names(tmp_path):
    """`mod.f`, `mod.Class.m`, `Class.m`, a bare function, a bare method name (each class's),
    `obj.m` (classes named ...Obj), a module-level value; the rest is not code."""
    readme = ("## One GRPO step\n`parts.make`, `role.Engine.run`, `Plain.get`, `use`, `go`,\n"
              "`engine.run`, `os.path`, `parts.Base.nothing`, `role.py`, `VALUE`\n")
    root = write(tmp_path, {"README.md": readme, "role.py": RESOLVE + "VALUE = {\n    1: 2}\n",
                            "support/__init__.py": "", "support/parts.py": PARTS})
    rep = reading_path.reading_path(root)
    assert [(ref, [f.qualname for f in fs]) for ref, fs in rep.starts] == [
        ("parts.make", ["make"]), ("role.Engine.run", ["Engine.run"]),
        ("Plain.get", ["Plain.get"]), ("use", ["use"]), ("go", ["Plain.go", "Fast.go"]),
        ("engine.run", ["Engine.run"]), ("VALUE", ["VALUE"])]
    assert rep.not_code == ["os.path", "parts.Base.nothing", "role.py"]
    assert counted(rep)[("role.py", "VALUE")] == (31, 32)


def test_without_the_section_it_says_what_is_missing(tmp_path):
    root = write(tmp_path, {"README.md": "# t\n## Files\n", "role.py": ROLE})
    r = subprocess.run([sys.executable, "scripts/reading_path.py", "--root", root], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "README.md has no line '## One GRPO step'" in r.stderr


def test_this_repository():
    """The command in the docstring runs here; every definition README's section names is
    counted, from its def line; the table adds up. No bound on the total: what the step
    reaches is what it reaches."""
    rep = reading_path.reading_path(ROOT)
    assert rep.starts, "README's One GRPO step names no function of the repository"
    for ref, funcs in rep.starts:
        for f in funcs:
            assert (f.module.path, f.qualname) in rep.reached, ref
    for r in rep.reached.values():
        f = r.func
        assert not f.module.path.startswith(("tests/", "bench/", "scripts/"))
        with open(os.path.join(ROOT, f.module.path), encoding="utf-8") as fh:
            head = fh.read().splitlines()[f.first - 1].strip()
        word = f.qualname.split(".")[-1]
        assert re.match(rf"(@|(async )?def {word}\b|{word}\b.*=)", head), (f.where, head)
    assert rep.lines == sum(row[2] for row in rep.files) >= rep.code > 0
    assert rep.lines >= sum(f.last - f.first + 1 for _, fs in rep.starts for f in fs)
    out = run()
    total = re.search(r"^total\s+(\d+)\s+(\d+)\s+(\d+)$", out, re.M)
    assert total and tuple(map(int, total.groups())) == (len(rep.reached), rep.lines, rep.code)
    for path, k, lines, code, _ in rep.files:
        assert re.search(rf"^{re.escape(path)}\s+{k}\s+{lines}\s+{code}$", out, re.M)
