"""Each default of a run is written once: support/defaults.py's table, read by jobs.sh (its
`--shell` lines), the CLIs (support/cli.py), the proxy (support/contract.CONTRACT) and the
keyword defaults of the loss, the step's record and the model (grpo_loss.py,
support/step_record.py, support/trainer_state.py); the readers' copies in docs/settings.md agree
with it (README's table: tests/test_fork.py).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_defaults.py -q
"""

import argparse
import ast
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from support import cli
from support.contract import CONTRACT
from support.defaults import DEFAULTS, TABLE, values
from support.rewards import add_task_flags

FLAGGED = {r.name for r in TABLE  # the rows a role takes as a flag
           if {"contract", "trainer", "rollout", "proxy"} & set(r.role.split())}


def literal_defaults(path):
    """[(flag, value)] of each flag of a table row that the file at path gives a literal default
    (`a("--flag", default=3e-4)`, `add_task_flags(p, default_task="arith")`), not the table's."""
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if not isinstance(node, ast.Call):
            continue
        first = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else ""
        flag = "task" if getattr(node.func, "id", "") == "add_task_flags" else \
            str(first)[2:].replace("-", "_") if str(first).startswith("--") else None
        found += [(flag, k.value.value) for k in node.keywords
                  if flag in FLAGGED | {"task"} and k.arg in ("default", "default_task")
                  and isinstance(k.value, ast.Constant) and k.value.value is not None]
    return found


def test_the_clis_take_their_defaults_from_the_table():
    """No flag of a table row has a literal default in support/cli.py, and each parses to the
    table's value (the contract's flags: proxy.py's)."""
    assert literal_defaults(os.path.join(ROOT, "support", "cli.py")) == []
    trainer = vars(cli.trainer_args(["--model", "m", "--bucket", "b", "--proxy", "p"]))
    replica = vars(cli.replica_args(["--model", "m", "--bucket", "b", "--proxy", "p"]))
    proxy = vars(cli.proxy_args([]))
    checked = 0
    for r in TABLE:
        for role, args in (("trainer", trainer), ("rollout", replica), ("contract", proxy),
                           ("proxy", proxy)):
            if role in r.role.split() and r.name in args and r.name != "task":
                assert args[r.name] == DEFAULTS[r.name], (role, r.name)
                checked += 1
    assert checked >= 60, checked


def test_the_check_finds_a_literal_default(tmp_path):
    """The check above can fail: a flag of the table with its value written in the file."""
    f = tmp_path / "cli.py"
    f.write_text('a("--learning-rate", type=float, default=3e-4)\na("--epsilon", default=0.2)\n'
                 'a("--dtype", default="float32")\nadd_task_flags(p, default_task="arith")\n')
    assert literal_defaults(str(f)) == [("learning_rate", 3e-4), ("epsilon", 0.2),
                                        ("task", "arith")]  # --dtype: no row


def test_every_default_of_trainer_py_is_a_row_of_the_table():
    """Each trainer.py flag parses, given none, to its row's default: a flag added with a literal
    default fails here. Only these have no row: the three required flags, the contract's (None:
    the proxy's, from GET /config) and the task flags (support/rewards.add_task_flags, with the
    replicas' row)."""
    args = vars(cli.trainer_args(["--model", "m", "--bucket", "b", "--proxy", "p"]))
    task_parser = argparse.ArgumentParser()
    add_task_flags(task_parser)
    task_flags = vars(task_parser.parse_args([]))
    contract = {r.name for r in TABLE if r.role == "contract"}
    for name, value in args.items():
        if name in ("model", "bucket", "proxy") or name in task_flags:
            continue
        if name in contract:
            assert value is None, name
        else:
            assert name in DEFAULTS, f"--{name.replace('_', '-')}: its default has no row"
            assert value == DEFAULTS[name], name


# importance_sampling_ratio's short names for its rows
ALIASES = {"mode": "vllm_importance_sampling_mode", "clip_max": "vllm_importance_sampling_clip_max",
           "clip_min": "vllm_importance_sampling_clip_min"}
# every flag's row but --port: proxy.serve's port 0 (any free one) is a library's, not the CLI's
ROWS = FLAGGED - {"port"}


def literal_keyword_defaults(path):
    """[(function, parameter, value)] of each parameter named as a flag's row (or by ALIASES)
    that a function in the file at path gives a literal default other than None (None: the
    caller gave none, e.g. policy_loss's delta, off as TRL's)."""
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if not isinstance(node, ast.FunctionDef):
            continue
        params = node.args.args[len(node.args.args) - len(node.args.defaults):] + \
            node.args.kwonlyargs
        defaults = node.args.defaults + node.args.kw_defaults  # kw_defaults: None for none
        found += [(node.name, a.arg, d.value) for a, d in zip(params, defaults)
                  if ALIASES.get(a.arg, a.arg) in ROWS and isinstance(d, ast.Constant)
                  and d.value is not None]
    return found


@pytest.mark.parametrize("path", ["grpo_loss.py", "trainer.py",
                                  os.path.join("support", "step_record.py"),
                                  os.path.join("support", "trainer_state.py"),
                                  os.path.join("support", "engines.py"), "proxy.py", "rollout.py",
                                  os.path.join("support", "worker_bounds.py"),
                                  os.path.join("support", "proxy_service.py"),
                                  os.path.join("support", "http_hardening.py"),
                                  os.path.join("support", "shared_prompt.py")])
def test_the_keyword_defaults_are_the_tables(path):
    """The loss's, the record's, the model's and the proxy's keywords repeat no default of the
    table: each reads DEFAULTS (or has none)."""
    assert literal_keyword_defaults(os.path.join(ROOT, path)) == []


def test_the_keyword_check_finds_a_literal_default(tmp_path):
    f = tmp_path / "loss.py"
    f.write_text("def f(x, epsilon=0.2, delta=None, mode='token_mask', *, lora_r=16, n=3):\n"
                 "    pass\n")
    assert literal_keyword_defaults(str(f)) == [("f", "epsilon", 0.2), ("f", "mode", "token_mask"),
                                                ("f", "lora_r", 16)]


def test_the_contract_is_the_proxy_rows():
    rows = {r.name: DEFAULTS[r.name] for r in TABLE if r.role == "contract"}
    assert CONTRACT == {**rows, "max_new_tokens": rows["max_completion_length"]}
    assert list(CONTRACT)[:len(rows)] == list(rows)  # GET /config's order


def jobs_sh_text():
    return "".join(open(os.path.join(ROOT, p), encoding="utf-8").read()
                   for p in ("jobs.sh", os.path.join("scripts", "jobs_lib.sh")))


def test_jobs_sh_writes_no_default_of_the_table():
    """jobs.sh and its plumbing set no table variable's default themselves (`${VAR:=...}`)."""
    table_vars = {r.var for r in TABLE if r.var}
    written = set(re.findall(r"\$\{(\w+):=", jobs_sh_text())) & table_vars
    assert written == set(), written
    assert "-m support.defaults --shell" in jobs_sh_text()


@pytest.mark.parametrize("mode", ["local", "hf"])
def test_the_shell_lines_set_the_tables_values_and_a_set_variable_wins(mode):
    """`python -m support.defaults --shell MODE`, run by bash as jobs.sh runs it, with python3
    without site-packages (the standard library only, as before setup.sh): every variable gets the
    mode's value, one the user set keeps its own, and MAX_NEW_TOKENS (the old name) is read."""
    want = values(mode)
    show = " ".join(f'{v}=${{{v}}}' for v in want)
    script = (f'set -eu; eval "$({sys.executable} -E -S -m support.defaults --shell {mode})"; '
              f'echo "{show}"')
    env = {"PATH": os.environ["PATH"], "SEED": "7", "MAX_NEW_TOKENS": "33"}
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = dict(w.split("=", 1) for w in r.stdout.split())
    assert got == {**want, "SEED": "7", "MAX_COMPLETION_LENGTH": "33"}


def test_the_table_imports_only_the_standard_library():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import support.defaults; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('support', 'torch', 'numpy', 'transformers')))")
    r = subprocess.run([sys.executable, "-I", "-c", code, ROOT], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["['support',", "'support.defaults']"], \
        r.stdout + r.stderr


def test_settings_md_agrees_with_the_table():
    """docs/settings.md's variables table: each value in backticks of a table variable is the
    table's value in that mode (a variable locally unset: the proxy's own, the code's)."""
    lines = open(os.path.join(ROOT, "docs", "settings.md"), encoding="utf-8").read().splitlines()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in lines if line.startswith("| `")]
    modes = {"local": {r.var: r.local or r.default for r in TABLE if r.var}, "hf": values("hf")}
    checked = 0
    for names, *cells in (r[:4] for r in rows if len(r) == 4):
        for mode, cell in zip(("local", "hf"), cells):
            for var, value in zip(re.findall(r"`(\w+)`", names), re.findall(r"`([^`]*)`", cell)):
                if var in modes[mode]:
                    assert modes[mode][var] == value, (var, mode, value)
                    checked += 1
    assert checked >= 2 * 20, checked
