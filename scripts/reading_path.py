"""How many lines a fresh reader reads to follow one GRPO step, following every call.

The reader starts at each definition README.md's "## One GRPO step" section names in backticks
(`Replica.step`, `RolloutBuffer.quota`, `trainer.flatten_groups`, `publish`, ...) and follows
every call those functions make into the repository's own code (the top-level *.py files and the
support/ package; not tests/, bench/, scripts/ or libraries), and every call those make, to the
end. Each function reached counts once, whole: from its def (or first decorator) to its last
line, docstring included; the `code` column leaves out blank, comment and docstring lines. Moving
a function to another file changes neither count: it follows the calls, not the files.

A call is followed when the code says where it goes (read from the AST, never run):
  f(...)           a function of the same module, or one imported from a repository module
  mod.f(...)       mod an imported repository module (`import sync`, `from support import cli`)
  Class(...)       the class's __init__ (its own or a base class's)
  self.m(...)      the method of self's class, its bases or mixins (and of subclasses that
                   override it: any of them may be self); super().m(...) likewise
  obj.m(...)       when obj's class is known: made here (`obj = Class(...)`), returned by a
                   function that makes it, a parameter every call in the repository passes one
                   to, or an attribute `self.obj = ...` set from one of these
  fn(...)          fn a parameter or variable every caller fills with a function of ours
A function passed by name (`key=self._order`, `target=run`) counts as reached too; a lambda's
calls count where it is written. A call that cannot be told (obj of unknown class, where a class
of ours has a method of that name; a callable in a variable) is not followed: the output counts
these calls, --verbose lists each with the methods it could reach, and a line says what following
all of them would add (a bound from above). Not followed either: what libraries call back (the
HTTP server calling a handler, torch calling a hook) and implicit dunder calls (`with`, `len`,
iteration). README names a definition as `mod.f`, `mod.Class.m`, `Class.m`, `f` (a
module-level function, else each method of that name) or `obj.m` (m of each class whose name
ends in obj: `engine.load_adapter`).

    .venv/bin/python scripts/reading_path.py            # per file, role files against support/
    .venv/bin/python scripts/reading_path.py --verbose  # and each function reached, and why; each
                                                        # call it could not follow
    .venv/bin/python -m pytest -q tests/test_reading_path.py
"""

import argparse
import ast
import builtins
import io
import os
import re
import textwrap
import tokenize
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "support"  # the role files' support code; the top-level *.py files are the role files
SECTION = "## One GRPO step"  # README.md's walk through the step
SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
BUILTINS = frozenset(dir(builtins))
# builtins that can hand back an object of ours (the rest make ints, strings, lists, ...)
PASS_THROUGH = {"getattr", "max", "min", "next", "iter", "vars", "type", "super", "reversed"}
PASS_MODULES = {"copy", "functools", "itertools", "operator", "weakref"}  # the same, for modules
LIB = "<library>"  # the class of a literal or of what a library made: none of its methods is ours
INNER = "<inner>"  # a lambda or a function defined inside another: counted where it is written
# a library's method returns a library's object, but for these, which hand back what was put in
LIB_ACCESSORS = {"get", "pop", "popitem", "setdefault", "popleft", "result", "get_nowait",
                 "__enter__", "__next__"}
CONTAINER_METHODS = frozenset(n for t in (dict, list, set, str, bytes, tuple) for n in dir(t))
EMPTY = frozenset()
TOP = None  # a type that cannot be told


# ---- the repository: its modules, classes and functions, read with ast

@dataclass(eq=False)
class Module:
    name: str  # "proxy", "support.leases"
    path: str  # "proxy.py", "support/leases.py"
    tree: ast.Module
    scope: dict = field(default_factory=dict)  # name -> ("module"|"def"|"class"|"from"|...)
    top: object = None  # top_level(module)


@dataclass(eq=False)
class Cls:
    module: Module
    node: ast.ClassDef
    bases: list = field(default_factory=list)  # [Cls], the repository's bases in order
    library_base: bool = False  # some base is a library's (its methods are not followed)
    methods: dict = field(default_factory=dict)  # name -> Func
    subclasses: list = field(default_factory=list)
    attrs: dict = field(default_factory=dict)  # name -> [(value, Func or None)]: self.name = value

    @property
    def name(self):
        return self.node.name

    def __repr__(self):
        return self.name


@dataclass(eq=False)
class Func:
    """A function or method (or, named in README, a module-level value) and what its body binds."""
    module: Module
    qualname: str  # "publish", "RolloutBuffer.quota"
    node: ast.AST
    cls: Cls = None
    kind: str = "function"  # "method", "staticmethod", "classmethod", "value"
    params: list = field(default_factory=list)  # positional names, self included
    kwonly: list = field(default_factory=list)  # keyword-only names
    defaults: dict = field(default_factory=dict)  # name -> default expression
    other_params: set = field(default_factory=set)  # *args, **kwargs
    local: dict = field(default_factory=dict)  # name -> [value expression or TOP]
    nested: set = field(default_factory=set)  # names of functions and classes defined inside
    imports: dict = field(default_factory=dict)  # name -> scope entry, for imports inside
    calls: list = field(default_factory=list)  # ast.Call nodes, nested functions' included
    refs: list = field(default_factory=list)  # Name/Attribute loads that are not called

    def __repr__(self):
        return self.qualname

    @property
    def first(self):
        return min([self.node.lineno] + [d.lineno for d in getattr(self.node, "decorator_list",
                                                                   [])])

    @property
    def last(self):
        return self.node.end_lineno

    @property
    def where(self):
        return f"{self.module.path}:{self.first}-{self.last}"

    @property
    def self_name(self):
        return self.params[0] if self.kind in ("method", "classmethod") and self.params else None


@dataclass
class Repo:
    root: str
    modules: dict  # name -> Module
    classes: list
    funcs: list
    methods: dict  # name -> [Func]: every method of that name, in any class
    attrs: set  # the names of the attributes our classes set (self.name = ...)


def module_files(root):
    """[(module name, path)]: the top-level *.py files, then the package's, sorted."""
    found = [(f[:-3], f) for f in sorted(os.listdir(root)) if f.endswith(".py")]
    for folder, dirs, files in sorted(os.walk(os.path.join(root, PACKAGE))):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.relpath(os.path.join(folder, f), root).replace(os.sep, "/")
                name = path[:-3].replace("/", ".")
                found.append((name[:-len(".__init__")] if f == "__init__.py" else name, path))
    return found


def import_entries(node, module, names):
    """{bound name: scope entry} of one import statement in `module`."""
    out = {}
    if isinstance(node, ast.Import):
        for a in node.names:
            full = a.asname and a.name or a.name.split(".")[0]
            out[a.asname or full] = ("module", full) if full in names else ("library",)
        return out
    base = node.module or ""
    if node.level:  # relative: from the package this module is in
        package = module.name.split(".") if module.path.endswith("__init__.py") else \
            module.name.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    for a in node.names:
        full = f"{base}.{a.name}" if base else a.name
        out[a.asname or a.name] = (("module", full) if full in names else
                                   ("from", base, a.name) if base in names else ("library",))
    return out


def module_scope(module, names):
    """The module's top-level names, through if/try blocks at module level."""
    def visit(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module.scope.update(import_entries(node, module, names))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                module.scope[node.name] = ("node", node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in getattr(node, "targets", [getattr(node, "target", None)]):
                    for n in ast.walk(t) if t is not None else []:
                        if isinstance(n, ast.Name):
                            module.scope[n.id] = ("value", node)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit([*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                       *[s for h in getattr(node, "handlers", []) for s in h.body]])
    visit(module.tree.body)


def bind(func, target, value):
    """Record what `target = value` binds in func: locals, or self.attr on func's class."""
    if isinstance(target, ast.Name):
        func.local.setdefault(target.id, []).append(value)
    elif isinstance(target, (ast.Tuple, ast.List)):
        pair = isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts)
        for i, t in enumerate(target.elts):
            bind(func, t, value.elts[i] if pair else TOP)
    elif isinstance(target, ast.Starred):
        bind(func, target.value, TOP)
    elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
          and func.cls is not None and target.value.id == func.self_name):
        func.cls.attrs.setdefault(target.attr, []).append((value, func))


def read_body(func, names):
    """Fill func's bindings, calls and references from its body (nested functions included)."""
    a = func.node.args
    func.params = [p.arg for p in a.posonlyargs + a.args]
    given = a.posonlyargs + a.args
    func.defaults = {p.arg: d for p, d in zip(given[len(given) - len(a.defaults):], a.defaults)}
    func.kwonly = [p.arg for p in a.kwonlyargs]
    func.defaults.update((p.arg, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d)
    func.other_params = {p.arg for p in [a.vararg, a.kwarg] if p is not None}
    called = set()
    for node in ast.walk(ast.Module(body=func.node.body, type_ignores=[])):
        if isinstance(node, ast.Call):
            func.calls.append(node)
            called.add(id(node.func))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for t in getattr(node, "targets", [getattr(node, "target", None)]):
                bind(func, t, node.value)
        elif isinstance(node, ast.NamedExpr):
            bind(func, node.target, node.value)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            bind(func, node.optional_vars, ast.Call(func=ast.Name("<enter>"),
                                                    args=[node.context_expr], keywords=[]))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension, ast.AugAssign)):
            bind(func, node.target, TOP)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            func.local.setdefault(node.name, []).append(TOP)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            func.nested.add(node.name)
        elif isinstance(node, ast.arguments):  # a nested function's or lambda's parameters
            for p in node.posonlyargs + node.args + node.kwonlyargs + [node.vararg, node.kwarg]:
                if p is not None:
                    func.local.setdefault(p.arg, []).append(TOP)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            func.imports.update(import_entries(node, func.module, names))
    for node in ast.walk(ast.Module(body=func.node.body, type_ignores=[])):
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load) \
                and id(node) not in called:
            func.refs.append(node)


def top_level(module):
    """A Func standing for module's top level, where its module-level values are computed."""
    if module.top is None:
        node = ast.FunctionDef(name="<module>", args=ast.arguments(
            posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None,
            defaults=[]), body=[], decorator_list=[], lineno=1, end_lineno=1)
        module.top = Func(module, "<module>", node)
    return module.top


def load(root=ROOT):
    """The repository's modules, classes and functions, each function's body read."""
    files = module_files(root)
    names = {n for n, _ in files} | {PACKAGE}
    modules = {}
    for name, path in files:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            modules[name] = Module(name, path, ast.parse(f.read(), path))
    if PACKAGE not in modules:  # a namespace package: no __init__.py
        modules[PACKAGE] = Module(PACKAGE, f"{PACKAGE}/", ast.Module(body=[], type_ignores=[]))
    classes, funcs, methods = [], [], {}
    for m in modules.values():
        module_scope(m, names)
        for node in m.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append(Func(m, node.name, node))
            elif isinstance(node, ast.ClassDef):
                c = Cls(m, node)
                classes.append(c)
                m.scope[node.name] = ("class", c)
                for d in node.body:
                    if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        deco = {getattr(x, "id", None) for x in d.decorator_list}
                        kind = next((k for k in ("staticmethod", "classmethod") if k in deco),
                                    "method")
                        c.methods[d.name] = f = Func(m, f"{c.name}.{d.name}", d, c, kind)
                        funcs.append(f)
                        methods.setdefault(d.name, []).append(f)
                    elif isinstance(d, (ast.Assign, ast.AnnAssign)) and d.value is not None:
                        for t in getattr(d, "targets", [getattr(d, "target", None)]):
                            if isinstance(t, ast.Name):
                                c.attrs.setdefault(t.id, []).append((d.value, None))
        for f in funcs:
            if f.module is m and f.cls is None:
                m.scope[f.node.name] = ("func", f)
    repo = Repo(root, modules, classes, funcs, methods, set())
    for c in classes:
        for b in c.node.bases:
            got = value_of(repo, b, None, c.module)
            if got and got[0] == "class":
                c.bases.append(got[1])
                got[1].subclasses.append(c)
            elif not (isinstance(b, ast.Name) and b.id == "object"):
                c.library_base = True
    for f in funcs:
        read_body(f, names)
    repo.attrs.update(a for c in classes for a in c.attrs)
    named = {f.node.name for f in funcs}  # a reference can name a function only by its name
    for f in funcs:
        f.refs = [n for n in f.refs if getattr(n, "id", getattr(n, "attr", None)) in named]
    return repo


def lookup(repo, module, name, seen=()):
    """What `name` is in module's scope: ("func", Func), ("class", Cls), ("module", Module),
    ("value", Module, node), ("library",), or None."""
    entry = module.scope.get(name)
    if entry is None:
        sub = f"{module.name}.{name}"
        return ("module", repo.modules[sub]) if sub in repo.modules else (
            ("library",) if name in BUILTINS else None)
    if entry[0] == "module":
        return ("module", repo.modules[entry[1]]) if entry[1] in repo.modules else ("library",)
    if entry[0] == "from":
        key = (entry[1], entry[2])
        return None if key in seen else lookup(repo, repo.modules[entry[1]], entry[2],
                                               (*seen, key))
    if entry[0] == "value":
        return ("value", module, entry[1])
    return entry if entry[0] in ("func", "class", "library") else None


def value_of(repo, expr, func, module):
    """What a Name or a dotted Attribute chain names, when that is fixed by the code: a module,
    a function, a class, a module-level value or a library's thing; None otherwise (a local, a
    parameter, an attribute of an object)."""
    if isinstance(expr, ast.Name):
        if func is not None:
            if expr.id in func.imports:
                e = func.imports[expr.id]
                return (("module", repo.modules[e[1]]) if e[0] == "module" else
                        lookup(repo, repo.modules[e[1]], e[2]) if e[0] == "from" else e)
            if expr.id in func.local or expr.id in func.nested or expr.id in func.params or \
                    expr.id in func.kwonly or expr.id in func.other_params:
                return None
        return lookup(repo, module, expr.id)
    if isinstance(expr, ast.Attribute):
        base = value_of(repo, expr.value, func, module)
        if base is None:
            return None
        if base[0] == "library":
            return base
        if base[0] == "module":
            return lookup(repo, base[1], expr.attr)
    return None


def mro(cls):
    """cls and its repository bases, depth first, each once (C3 agrees for these hierarchies)."""
    out = []
    for c in [cls, *[m for b in cls.bases for m in mro(b)]]:
        if c not in out:
            out.append(c)
    return out


def find_method(cls, name, after=None):
    """The method `name` resolves to on an instance of cls (searching past `after`, for super());
    None when no class of ours in its MRO defines it."""
    order = mro(cls)
    if after is not None:
        order = order[order.index(after) + 1:] if after in order else []
    return next((c.methods[name] for c in order if name in c.methods), None)


def below(cls):
    """cls and every repository class derived from it: what `self` may be in cls's methods."""
    out = [cls]
    for c in out:
        out.extend(s for s in c.subclasses if s not in out)
    return out


# ---- types, as far as the code tells them: what an expression may hold. A type is a set of
# Cls (an instance of it), Func (the function itself; a method: bound), LIB (an object a library
# or a literal made: its methods are not ours) and INNER (a lambda or a function defined inside
# another: its calls are followed where it is written); TOP: cannot tell.

def union(types):
    out = set()
    for t in types:
        if t is TOP:
            return TOP
        out |= t
    return frozenset(out)


def known(t):
    return t is not TOP and bool(t)


class Types:
    """The types of expressions, given what each parameter is assumed to hold."""

    def __init__(self, repo, params, top=frozenset(), optimistic=False):
        self.repo, self.params = repo, params  # params: {(Func, name): type}
        self.top = top  # functions whose parameters are unknown
        self.optimistic = optimistic  # infer: an object nothing reaches yet is called: "pending"
        self.memo, self.busy, self.pending = {}, set(), set()

    def guard(self, key, compute):
        """compute(), once. A name whose type depends on itself (x = x or f()) adds nothing
        through that path: the least fixed point, kept only once the cycle is closed."""
        if key in self.memo:
            return self.memo[key]
        if key in self.busy:
            self.pending.add(key)
            return EMPTY
        self.busy.add(key)
        outer, self.pending = self.pending, set()
        try:
            out = compute()
        finally:
            self.busy.discard(key)
            inner = self.pending - {key}
            self.pending = outer | inner
        if not inner:
            self.memo[key] = out
        return out

    def of(self, expr, func, module):
        """The type of expr, written in func (None: at module level)."""
        if expr is TOP:
            return TOP
        func = func or top_level(module)
        return self.guard(("expr", id(expr), id(func)), lambda: self._of(expr, func, module))

    def var(self, func, name):
        def compute():
            given = [self.param(func, name)] if name in func.params or name in func.kwonly \
                else []
            return union([*given, *(self.of(v, func, func.module)
                                    for v in func.local.get(name, []))])
        return self.guard(("var", id(func), name), compute)

    def param(self, func, name):
        return TOP if func in self.top else self.params.get((func, name), EMPTY)

    def _of(self, e, func, module):
        if isinstance(e, ast.Constant):
            return EMPTY if e.value is None else frozenset({LIB})
        if isinstance(e, (ast.JoinedStr, ast.List, ast.Dict, ast.Set, ast.Tuple, ast.ListComp,
                          ast.DictComp, ast.SetComp, ast.GeneratorExp, ast.BinOp, ast.UnaryOp,
                          ast.Compare)):
            return frozenset({LIB})
        if isinstance(e, ast.Lambda):
            return frozenset({INNER})
        if isinstance(e, (ast.BoolOp, ast.IfExp)):
            parts = e.values if isinstance(e, ast.BoolOp) else [e.body, e.orelse]
            return union(self.of(p, func, module) for p in parts)
        if isinstance(e, ast.NamedExpr):
            return self.of(e.value, func, module)
        if isinstance(e, ast.Name) and func is not None:
            if e.id == func.self_name:
                return frozenset(below(func.cls))
            if e.id in func.nested and e.id not in func.imports:
                return frozenset({INNER})
            if e.id in func.other_params:
                return TOP
            if e.id in func.params or e.id in func.kwonly or e.id in func.local:
                return self.var(func, e.id)
        if isinstance(e, (ast.Name, ast.Attribute)):
            fixed = value_of(self.repo, e, func, module)
            if fixed is not None:
                return self.fixed(fixed)
            if isinstance(e, ast.Attribute):
                return self.attr(self.of(e.value, func, module), e.attr)
            return TOP
        if isinstance(e, ast.Call):
            if isinstance(e.func, ast.Name) and e.func.id == "<enter>":  # with x as y
                return self.entered(self.of(e.args[0], func, module))
            return self.made(resolve(self.repo, self, e, func))
        return TOP

    def fixed(self, fixed):
        """The type of what value_of found."""
        if fixed[0] == "func":
            return frozenset({fixed[1]})
        if fixed[0] == "library":
            return frozenset({LIB})
        if fixed[0] == "value":
            module, node = fixed[1], fixed[2]
            single = isinstance(node, ast.AnnAssign) or len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name)
            return self.of(node.value, None, module) if single and node.value else TOP
        return TOP  # a module or a class itself

    def made(self, site):
        """The type of what a call returns."""
        if site.kind == "library":
            return frozenset({LIB}) if site.makes_library else TOP
        if site.kind == "pending":
            return EMPTY
        if site.kind != "repository":
            return TOP
        return union([frozenset(site.made), *(self.returns(f) for f, _ in site.targets
                                               if f.node.name != "__init__")])

    def attr(self, owner, name):
        """The type of owner.name: what `self.name = ...` assigns in the owner's classes, or
        the method of that name."""
        if not known(owner):
            return TOP
        found = []
        for c in owner:
            if not isinstance(c, Cls):
                found.append(frozenset({LIB}))  # an attribute of a library's object
                continue
            values = [v for k in mro(c) for v in k.attrs.get(name, [])]
            method = find_method(c, name)
            if values:
                found.append(self.guard(("attr", id(c), name), lambda: union(
                    self.of(v, f, f.module if f else c.module) for v, f in values)))
            elif method is not None:
                found.append(frozenset({method}))
            elif c.library_base:
                found.append(TOP)
        return union(found) if found else TOP

    def returns(self, func):
        def compute():
            if func.kind == "value" or [d for d in func.node.decorator_list if getattr(
                    d, "id", None) not in ("staticmethod", "classmethod")]:
                return TOP
            values, stack = [], list(func.node.body)
            while stack:  # the function's own returns, not its nested functions'
                n = stack.pop()
                if isinstance(n, (ast.Yield, ast.YieldFrom)):
                    return TOP
                if isinstance(n, ast.Return):
                    values.append(n.value)
                if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                      ast.ClassDef)):
                    stack.extend(ast.iter_child_nodes(n))
            return union(self.of(v, func, func.module) if v is not None else EMPTY
                         for v in values)
        return self.guard(("returns", id(func)), compute)

    def entered(self, t):
        """`with x as y`: y is x when x's __enter__ returns self, as ours do."""
        if known(t) and t == {LIB}:
            return t  # a library's context manager gives a library's object: open() as f
        if not known(t) or not all(isinstance(c, Cls) for c in t):
            return TOP
        for c in t:
            enter = find_method(c, "__enter__")
            rets = [n for n in ast.walk(enter.node) if isinstance(n, ast.Return)] if enter else []
            if not rets or not all(isinstance(r.value, ast.Name) and r.value.id ==
                                   enter.self_name for r in rets):
                return TOP
        return t


# ---- calls: where each one goes

@dataclass
class Site:
    kind: str  # "repository", "library", "local" (a lambda or inner function), "unresolved",
    # "pending" (infer: nothing reaches the object called yet)
    targets: list = field(default_factory=list)  # [(Func, how)]: how "call", "bound", "unbound"
    made: list = field(default_factory=list)  # classes of ours it constructs
    candidates: list = field(default_factory=list)  # unresolved: the methods it could reach
    makes_library: bool = True  # library: what it returns is a library's object


def construct(classes):
    inits = [find_method(c, "__init__") for c in classes]
    return Site("repository", [(f, "bound") for f in inits if f is not None], list(classes))


def join(parts, candidates):
    """One Site from what each possible callee gave: [Site]."""
    targets = list(dict.fromkeys(t for p in parts for t in p.targets))
    made = list(dict.fromkeys(c for p in parts for c in p.made))
    kinds = {p.kind for p in parts}
    if targets or made:
        return Site("repository", targets, made)
    if not parts or "unresolved" in kinds:
        return Site("unresolved", candidates=candidates)
    if "pending" in kinds:
        return Site("pending")
    if kinds == {"local"}:
        return Site("local")
    return Site("library", makes_library=all(p.makes_library for p in parts))


def call_value(repo, types, t, name=None):
    """Calling something of type t (name: the method's, for the candidates)."""
    parts = []
    for v in t:
        if isinstance(v, Func):
            how = "bound" if v.cls is not None and v.kind != "staticmethod" else "call"
            parts.append(Site("repository", [(v, how)]))
        elif v == INNER:
            parts.append(Site("local"))
        elif v == LIB:
            parts.append(Site("library", makes_library=False))
        else:  # an instance of ours, called
            m = find_method(v, "__call__")
            parts.append(Site("repository", [(m, "bound")]) if m else Site("unresolved"))
    return join(parts, repo.methods.get(name, []) if name else [])


def on_instances(repo, types, t, name):
    """obj.name(...) where obj has type t."""
    parts = []
    for c in t:
        if not isinstance(c, Cls):  # a library's object, or a function's attribute
            library = name in LIB_ACCESSORS
            parts.append(Site("library", makes_library=not library))
            continue
        m = find_method(c, name)
        if m is not None:
            parts.append(Site("repository", [(m, "bound")]))
        elif any(name in k.attrs for k in mro(c)):  # a callable held in an attribute
            held = types.attr(frozenset({c}), name)
            parts.append(call_value(repo, types, held, name) if known(held) else
                         Site("pending" if held == EMPTY and types.optimistic else
                              "unresolved"))
        elif c.library_base:
            parts.append(Site("library", makes_library=False))
    return join(parts, repo.methods.get(name, []))


def resolve(repo, types, call, func):
    """Where call (in func) goes: a Site."""
    f, module = call.func, func.module
    if isinstance(f, ast.Name) and f.id == func.self_name and func.kind == "classmethod":
        return construct(below(func.cls))
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call) and \
            isinstance(f.value.func, ast.Name) and f.value.func.id == "super" and func.cls:
        hits = [find_method(c, f.attr, after=func.cls) for c in below(func.cls)]
        hits = list(dict.fromkeys(h for h in hits if h is not None))
        return Site("repository", [(h, "bound") for h in hits]) if hits else \
            Site("library", makes_library=False)
    fixed = value_of(repo, f, func, module)
    if fixed is not None:
        if fixed[0] == "func":
            return Site("repository", [(fixed[1], "call")])
        if fixed[0] == "class":
            return construct([fixed[1]])
        if fixed[0] == "library":
            root = f
            while isinstance(root, ast.Attribute):
                root = root.value
            passes = (getattr(f, "id", None) in PASS_THROUGH or
                      getattr(root, "id", None) in PASS_MODULES)
            return Site("library", makes_library=not passes)
        t = types.fixed(fixed)  # a module-level value: MATH_SCORER = MathScorer()
        return call_value(repo, types, t) if known(t) else Site("unresolved")
    if isinstance(f, ast.Attribute):
        owner = value_of(repo, f.value, func, module)
        if owner is not None and owner[0] == "class":  # Class.method(obj, ...)
            m = find_method(owner[1], f.attr)
            how = "bound" if m is not None and m.kind in ("staticmethod", "classmethod") else \
                "unbound"
            return Site("repository", [(m, how)]) if m is not None else (
                Site("library", makes_library=False) if owner[1].library_base else
                Site("unresolved", candidates=repo.methods.get(f.attr, [])))
        t = types.of(f.value, func, module)
        if known(t):
            return on_instances(repo, types, t, f.attr)
        if t == EMPTY and types.optimistic:
            return Site("pending")  # nothing reaches obj yet
        held = f.attr in repo.attrs and f.attr not in CONTAINER_METHODS  # obj.items(): a dict's
        if f.attr not in repo.methods and not held:  # no class of ours has it
            return Site("library", makes_library=f.attr not in LIB_ACCESSORS)
        return Site("unresolved", candidates=repo.methods.get(f.attr, []))
    t = types.of(f, func, module)  # a function held in a variable, or computed
    if t == EMPTY and types.optimistic:
        return Site("pending")
    return call_value(repo, types, t) if known(t) else Site("unresolved")


def referenced(types, node, func):
    """The functions of ours a Name or Attribute that is not called names: [Func]."""
    t = types.of(node, func, func.module)
    return [f for f in t if isinstance(f, Func)] if known(t) else []


def infer(repo, rounds=50):
    """Types, with each parameter's type: the union of what every call in the repository passes
    it; unknown (`top`) for a function no call of ours reaches (a library calls it, or nothing
    does), one a call that cannot be told may reach, or one passed by name. Found from knowing
    nothing, round by round, each adding what the calls pass given the last round's types, until
    nothing changes (types only grow: it settles); then again, the functions found unknown added,
    until those stay the same."""
    top = frozenset()
    for _ in range(rounds):
        params, unknown = {}, set()
        for _ in range(rounds):
            new, called, more = settle(repo, Types(repo, params, top | unknown, optimistic=True))
            grown = {k: union([params.get(k, EMPTY), new.get(k, EMPTY)])
                     for k in params.keys() | new.keys()}
            if grown == params and more <= unknown:
                break
            params, unknown = grown, unknown | more
        found = top | unknown | {f for f in repo.funcs if f not in called}
        if found == top:
            return Types(repo, params, top)
        top = frozenset(found)
    return Types(repo, {}, frozenset(repo.funcs))  # did not settle: every parameter unknown


def settle(repo, types):
    """(params, called, unknown): what the calls pass, given types."""
    given, called, unknown = {}, set(), set()  # given: (Func, name) -> [types]
    for func in repo.funcs:
        for call in func.calls:
            site = resolve(repo, types, call, func)
            unknown.update(site.candidates)
            for g, how in site.targets:
                called.add(g)
                pass_args(types, call, func, g, how, given)
        for node in func.refs:
            unknown.update(referenced(types, node, func))
    return {key: union(ts) for key, ts in given.items()}, called, unknown


def pass_args(types, call, caller, g, how, given):
    """Add what call passes to each of g's parameters to given."""
    names = g.params[1:] if g.kind in ("method", "classmethod") and how != "call" else g.params
    args = call.args[1:] if how == "unbound" else call.args
    star = next((i for i, a in enumerate(args) if isinstance(a, ast.Starred)), None)
    args = args if star is None else args[:star]
    passed = dict(zip(names, args))
    passed.update((k.arg, k.value) for k in call.keywords if k.arg is not None)
    spread = any(k.arg is None for k in call.keywords)  # **kwargs
    for i, name in enumerate(names + g.kwonly):
        if name in passed:
            t = types.of(passed[name], caller, caller.module)
        elif spread or (star is not None and i >= len(args) and name in names):
            t = TOP
        elif name in g.defaults:
            t = types.of(g.defaults[name], None, g.module)
        else:
            continue
        given.setdefault((g, name), []).append(t)


# ---- README's names, and the walk from them

def section(root, heading=SECTION):
    """(first, last, text): the section's lines, 1-based and inclusive, and its prose (fenced
    code blocks left out)."""
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    first = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if first is None:
        raise SystemExit(f"reading_path.py: error: README.md has no line {heading!r}: "
                         "the walk starts from the functions that section names")
    last = next((i for i in range(first + 1, len(lines)) if lines[i].startswith("## ")),
                len(lines))
    prose = re.sub(r"(?ms)^```.*?^```", "", "\n".join(lines[first:last]))
    return first + 1, last, prose


def modules_named(repo, name):
    exact = [m for n, m in repo.modules.items() if n == name]
    return exact or [m for n, m in repo.modules.items() if n.endswith("." + name)]


def named(repo, ref):
    """The definitions a backticked name in README stands for: [Func]. `mod.f`, `mod.Class.m`,
    `Class.m`, `f` (a module-level function; else every method of that name), `obj.m` (the
    method m of each class whose name ends in obj: `engine.load_adapter`)."""
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        mods = modules_named(repo, ".".join(parts[:i]))
        if mods:
            return [f for m in mods for f in in_module(repo, m, parts[i:])]
    classes = [c for c in repo.classes if c.name == parts[0]]
    if classes and len(parts) == 2:
        return list(dict.fromkeys(f for c in classes for f in [find_method(c, parts[1])] if f))
    if len(parts) == 1:
        found = [m for m in repo.modules.values() for f in [in_module(repo, m, parts)] if f]
        top = [m for m in found if "." not in m.name] or found
        return [f for m in top for f in in_module(repo, m, parts)] or \
            list(repo.methods.get(ref, []))
    if len(parts) == 2:
        word = parts[0].replace("_", "").lower()
        return [f for c in repo.classes if c.name.lower().endswith(word)
                for f in [find_method(c, parts[1])] if f]
    return []


def in_module(repo, module, rest):
    if len(rest) not in (1, 2):
        return []
    got = module.scope.get(rest[0]) and lookup(repo, module, rest[0])
    if not got:
        return []
    if got[0] == "func" and len(rest) == 1:
        return [got[1]]
    if got[0] == "class":
        f = find_method(got[1], rest[1] if len(rest) == 2 else "__init__")
        return [f] if f else []
    if got[0] == "value" and len(rest) == 1:
        return [Func(got[1], rest[0], got[2], kind="value")]
    return []


@dataclass
class Reached:
    func: Func
    why: str  # "named in README as `x`", "called at file:line", "referenced at file:line"


def walk(repo, types, starts, every_candidate=False):
    """{(path, qualname): Reached}: starts and everything they call, transitively, in order.
    every_candidate: follow each unresolved call to every method it could reach, too."""
    seen, queue = {}, []
    for ref, funcs in starts:
        for f in funcs:
            key = (f.module.path, f.qualname)
            if key not in seen:
                seen[key] = Reached(f, f"named in README as `{ref}`")
                queue.append(f)
    while queue:
        f = queue.pop(0)
        if f.kind == "value":
            continue
        out = []
        for call in f.calls:
            site = resolve(repo, types, call, f)
            go = [g for g, _ in site.targets] + (site.candidates if every_candidate else [])
            out += [(g, f"called at {f.module.path}:{call.lineno} ({f.qualname})") for g in go]
        for node in f.refs:
            out += [(g, f"referenced at {f.module.path}:{node.lineno} ({f.qualname})")
                    for g in referenced(types, node, f)]
        for g, why in out:
            key = (g.module.path, g.qualname)
            if key not in seen:
                seen[key] = Reached(g, why)
                queue.append(g)
    return seen


# ---- counting

def code_lines(source):
    """{line number}: the lines that hold code (not blank, not only a comment, not a
    docstring)."""
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            code.difference_update(range(body[0].lineno, body[0].end_lineno + 1))
    return code


@dataclass
class Report:
    section: tuple  # (first, last) of README's section
    starts: list  # [(name, [Func])]: the names README gives that are definitions here
    not_code: list  # the backticked names in the section that are not
    reached: dict  # (path, qualname) -> Reached
    files: list  # [(path, functions, lines, code, [(first, last)])]
    lines: int
    code: int
    top_lines: int  # of those, in the top-level (role) files
    top_code: int
    calls: dict  # kind -> number of calls in the reached functions
    unresolved: list  # [(path, line, call text, in function, [candidate Func])]
    bound: tuple  # (functions, lines, code) when every unresolved call is followed everywhere


def tally(repo, reached):
    """[(path, functions, lines, code, ranges)], in module order; totals come from these."""
    code = {}
    rows = []
    for m in repo.modules.values():
        mine = sorted((r.func for r in reached.values() if r.func.module is m),
                      key=lambda f: f.first)
        if not mine:
            continue
        if m.path not in code:
            with open(os.path.join(repo.root, m.path), encoding="utf-8") as f:
                code[m.path] = code_lines(f.read())
        spans = set()
        for f in mine:
            spans.update(range(f.first, f.last + 1))
        rows.append((m.path, len(mine), len(spans), len(spans & code[m.path]),
                     [(f.first, f.last) for f in mine]))
    return rows


def reading_path(root=ROOT):
    """Everything main prints, as a Report."""
    repo = load(root)
    types = infer(repo)
    first, last, prose = section(root)
    refs = []
    for span in SPAN.findall(prose):
        span = span.strip().removesuffix("()")
        if DOTTED.fullmatch(span) and span not in refs:
            refs.append(span)
    starts, not_code = [], []
    for ref in refs:
        funcs = named(repo, ref)
        (starts.append((ref, funcs)) if funcs else not_code.append(ref))
    reached = walk(repo, types, starts)
    files = tally(repo, reached)
    calls, unresolved = {}, []
    for r in reached.values():
        for call in r.func.calls if r.func.kind != "value" else []:
            site = resolve(repo, types, call, r.func)
            kind = "repository" if site.kind == "local" else site.kind
            calls[kind] = calls.get(kind, 0) + 1
            if kind == "unresolved":
                unresolved.append((r.func.module.path, call.lineno, call.col_offset,
                                   ast.unparse(call.func), r.func.qualname, site.candidates))
    wide = tally(repo, walk(repo, types, starts, every_candidate=True))
    top = [row for row in files if "/" not in row[0]]
    total = [sum(r[i] for r in files) for i in (2, 3)]
    return Report((first, last), starts, not_code, reached, files, *total,
                  sum(r[2] for r in top), sum(r[3] for r in top), calls,
                  sorted(unresolved, key=lambda u: u[:3]),
                  tuple(sum(r[i] for r in wide) for i in (1, 2, 3)))


def ranges(spans, width=92, indent="    "):
    out, line = [], indent
    for a, b in spans:
        word = f"{a}-{b}" if b > a else f"{a}"
        if len(line) + len(word) + 1 > width and line.strip():
            out.append(line)
            line = indent
        line += ("" if line == indent else " ") + word
    return out + [line]


def share(part, whole):
    return f"{100 * part / whole:.0f}%" if whole else "-"


def print_report(rep, verbose=False):
    first, last = rep.section
    n = sum(len(fs) for _, fs in rep.starts)
    print(f"One GRPO step, every call followed: the {n} definitions README.md lines "
          f"{first}-{last} name\nreach {len(rep.reached)} functions (lines: def to end; code: "
          "without blank, comment and docstring lines)\n")
    print(f"{'file':<28}{'functions':>10}{'lines':>8}{'code':>8}")
    for path, k, lines, code, spans in rep.files:
        print(f"{path:<28}{k:>10}{lines:>8}{code:>8}")
        print("\n".join(ranges(spans)))
    k = sum(r[1] for r in rep.files if "/" not in r[0])
    rows = [("top level (role files)", k, rep.top_lines, rep.top_code),
            (PACKAGE + "/", len(rep.reached) - k, rep.lines - rep.top_lines,
             rep.code - rep.top_code)]
    for name, k, lines, code in rows:
        print(f"{name:<28}{k:>10}{lines:>8}{code:>8}   {share(lines, rep.lines)} of the lines, "
              f"{share(code, rep.code)} of the code")
    print(f"{'total':<28}{len(rep.reached):>10}{rep.lines:>8}{rep.code:>8}\n")
    c = rep.calls
    print(f"calls in these functions: {sum(c.values())}; into the repository "
          f"{c.get('repository', 0)}, to libraries\nand builtins {c.get('library', 0)}, "
          f"not resolved {c.get('unresolved', 0)} (--verbose lists them)")
    k, lines, code = rep.bound
    print(f"if each unresolved call went to every method of ours of its name: {k} functions, "
          f"{lines} lines,\n{code} code")
    print(textwrap.fill("backticked in the section but not a definition here: " +
                        ", ".join(rep.not_code), 99))
    if not verbose:
        return
    print("\nREADME's names:")
    for ref, funcs in rep.starts:
        print(f"  `{ref}`: {', '.join(f'{f.qualname} ({f.where})' for f in funcs)}")
    print("\neach function reached, and how:")
    for r in rep.reached.values():
        f = r.func
        print(f"  {f.where:<32} {f.qualname:<36} {f.last - f.first + 1:>4}  {r.why}")
    print("\ncalls not resolved, with the methods of ours each could reach:")
    for path, line, _, text, where, cands in rep.unresolved:
        could = ", ".join(f.qualname for f in cands) or "(a callable held in a variable)"
        print(f"  {path}:{line} {text}(...) in {where}: {could}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=ROOT, help="the repository (default: this script's)")
    p.add_argument("--verbose", action="store_true",
                   help="also list each function reached and why, and each unresolved call")
    args = p.parse_args(argv)
    rep = reading_path(args.root)
    print_report(rep, args.verbose)
    return rep


if __name__ == "__main__":
    main()
