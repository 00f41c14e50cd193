"""The repository's shape, checked from the source (no import runs):

- the top level holds the card's files: the five role files, jobs.sh, setup.sh, the two
  requirement files, README.md, and folders;
- everything else a role needs lives in one package, support/, which never imports a role file;
- no import cycle among the repository's modules, no module-level __getattr__ (no re-export
  shims), and every `from X import name` of a repository module names something X defines.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_layout.py -q
"""

import ast
import os
import subprocess

import pytest

from conftest import ROOT

ROLES = {"trainer", "rollout", "proxy", "grpo_loss", "sync"}
CARD = {f"{r}.py" for r in ROLES} | {"jobs.sh", "setup.sh", "requirements.txt",
                                      "requirements-test.txt", "README.md", ".gitignore"}
PACKAGE = "support"


def tracked(root=ROOT):
    """The files git tracks, relative to root."""
    out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True)
    return out.stdout.split()


def modules(root=ROOT):
    """{module name: path} of the repository's code: the top-level .py files and the package."""
    found = {}
    for rel in tracked(root):
        parts = rel.split("/")
        if rel.endswith(".py") and (len(parts) == 1 or (len(parts) == 2 and parts[0] == PACKAGE)):
            name = rel[:-3].replace("/", ".")
            found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = rel
    return found


def imports(path, known):
    """[(line, imported module, names or None)] of the repository modules a file imports
    (anywhere in it, functions included)."""
    tree = ast.parse(open(path).read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known:
            names = [a.name for a in node.names]
            subs = [n for n in names if f"{node.module}.{n}" in known]  # from support import x
            out += [(node.lineno, f"{node.module}.{n}", None) for n in subs]
            rest = [n for n in names if n not in subs]
            if rest:
                out.append((node.lineno, node.module, rest))
    return out


def defined(path):
    """The names a module defines at its top level (def, class, assignment), not imports."""
    tree = ast.parse(open(path).read(), path)
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def cycle(graph):
    """One import cycle of graph {module: {modules it imports}} as a list, or None."""
    state = {}

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n, path + [n])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_the_top_level_holds_the_card():
    top = {rel.split("/")[0] for rel in tracked()}
    files = {t for t in top if os.path.isfile(os.path.join(ROOT, t))}
    assert files <= CARD, f"not on the card: {sorted(files - CARD)}: move them into {PACKAGE}/, " \
                          "scripts/ or docs/"
    assert {f"{r}.py" for r in ROLES} | {"jobs.sh", "README.md"} <= files


def test_the_package_imports_no_role_file_and_nothing_imports_in_a_circle():
    known = modules()
    graph = {m: {i for _, i, _ in imports(os.path.join(ROOT, p), known)} - {m}
             for m, p in known.items()}
    for m, deps in graph.items():
        if m.startswith(PACKAGE):
            assert not deps & ROLES, f"{known[m]} imports the role file(s) {sorted(deps & ROLES)}"
    assert cycle(graph) is None, f"import cycle: {' -> '.join(cycle(graph))}"


def test_no_module_getattr_and_every_name_imported_from_where_it_is_defined():
    known = modules()
    for m, rel in known.items():
        tree = ast.parse(open(os.path.join(ROOT, rel)).read())
        assert not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
                       for n in tree.body), f"{rel}: a module-level __getattr__"
    # tests and benchmarks too: a name comes from the module that defines it
    users = [rel for rel in tracked() if rel.endswith(".py")]
    for rel in users:
        for line, mod, names in imports(os.path.join(ROOT, rel), known):
            if names:
                missing = set(names) - defined(os.path.join(ROOT, known[mod]))
                assert not missing, f"{rel}:{line} imports {sorted(missing)} from {mod}, " \
                                    "which does not define them"


def test_the_checks_can_fail(tmp_path):
    """The helpers above on a made-up repository: a cycle, a re-export, a package importing a
    role."""
    (tmp_path / PACKAGE).mkdir()
    (tmp_path / "trainer.py").write_text("from support.a import f\n")
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (tmp_path / PACKAGE / "a.py").write_text("import trainer\nfrom support.b import g as f\n")
    (tmp_path / PACKAGE / "b.py").write_text("def g():\n    pass\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    known = modules(str(tmp_path))
    assert set(known) == {"trainer", "support", "support.a", "support.b"}
    graph = {m: {i for _, i, _ in imports(os.path.join(tmp_path, p), known)} - {m}
             for m, p in known.items()}
    assert graph["support.a"] == {"trainer", "support.b"}
    assert cycle(graph) == ["support.a", "trainer", "support.a"]
    assert "f" not in defined(os.path.join(tmp_path, PACKAGE, "a.py"))  # f is re-exported there


@pytest.mark.parametrize("name", sorted(ROLES))
def test_each_role_file_reads_in_one_sitting(name):
    """STYLE.md: a role file past ~350 lines is cut or split before anything is added."""
    with open(os.path.join(ROOT, f"{name}.py")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 360, f"{name}.py has {len(lines)} lines"
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 100]
    assert not long, f"{name}.py: lines over 100 characters: {long[:10]}"
