"""README.md's two lists a reader copies from, checked against the repository.

1. The fork list ("## Forking": the `cp` line). The test copies exactly the paths that line
   names into an empty folder and runs the system there as real processes: the proxy, one
   replica (--engine hf, the toy task) and the trainer, on the tiny test model, with the .venv's
   python, cwd in the fork and PYTHONPATH unset (so nothing of this repository is importable but
   what was copied). It passes when the trainer finished its steps and published an adapter per
   step, and the replica and the proxy exited by themselves. A list that misses a file a role
   imports fails it: `test_a_fork_without_support_does_not_start` drops `support` from the list
   and shows the proxy dying on the import.
2. The table of "the variables you are most likely to change" (## Running): every default in
   backticks is the one jobs.sh sets, in the same mode (support/defaults.py's, or jobs.sh's own
   for the launch's variables).
3. "Your own task" (## Running): its commands, run as written with HOME in a temporary folder,
   make the dataset and the reward file, and the task check jobs.sh runs first passes on them.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q tests/test_fork.py
"""

import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, free_port, wait_port
from support.defaults import values

STEPS = 3  # trainer steps of the fork's run


def readme_section(heading):
    """The lines of README.md's `## heading` section, up to the next `## `."""
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()
    first = lines.index(f"## {heading}")
    last = next((i for i in range(first + 1, len(lines)) if lines[i].startswith("## ")),
                len(lines))
    return lines[first + 1:last]


def fork_list():
    """The paths README's `cp` line copies: [path], as written (a folder without its slash)."""
    text = "\n".join(readme_section("Forking")).replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.lstrip().startswith("cp "))
    words = [w for w in shlex.split(line)[1:] if not w.startswith("-")]
    return [w.rstrip("/") for w in words[:-1]]  # the last word is the destination


def make_fork(paths, dest):
    """Copy each path (a file or a folder) of the repository into dest; nothing else."""
    os.makedirs(dest)
    for p in paths:
        src = os.path.join(ROOT, p)
        assert os.path.exists(src), f"README's fork list names {p}, which this repository lacks"
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, p),
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            os.makedirs(os.path.dirname(os.path.join(dest, p)) or dest, exist_ok=True)
            shutil.copy2(src, os.path.join(dest, p))


def fork_env():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", PROXY_TOKEN="fork-test")
    return env


def test_the_fork_list_names_the_roles_and_their_package():
    paths = fork_list()
    assert {"trainer.py", "rollout.py", "proxy.py", "grpo_loss.py", "sync.py", "support"} \
        <= set(paths), paths


def test_a_fork_of_the_listed_files_runs(tiny_model, tmp_path):
    fork, bucket = str(tmp_path / "fork"), str(tmp_path / "bucket")
    make_fork(fork_list(), fork)
    env, py = fork_env(), sys.executable
    # the fork's python sees the fork, the .venv and the standard library: not this repository
    found = subprocess.run([py, "-c", "import sys, support; print(support.__file__); "
                            "print('\\n'.join(sys.path))"], cwd=fork, env=env,
                           capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stderr
    where, *path = found.stdout.splitlines()
    assert where == os.path.join(fork, "support", "__init__.py")
    venv = os.path.join(ROOT, ".venv")
    assert not [p for p in path if os.path.abspath(p or fork).startswith(ROOT + os.sep)
                and not os.path.abspath(p).startswith(venv + os.sep)], path

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs = {r: open(tmp_path / f"{r}.log", "w+") for r in ("proxy", "replica")}
    procs = {}
    try:
        procs["proxy"] = subprocess.Popen(
            [py, "proxy.py", "--port", str(port), "--num-generations", "4",
             "--groups-per-step", "2", "--max-staleness", "1", "--max-completion-length", "6",
             "--linger", "20"], cwd=fork, env=env, stdout=logs["proxy"],
            stderr=subprocess.STDOUT)
        wait_port(port)
        procs["replica"] = subprocess.Popen(
            [py, "rollout.py", "--engine", "hf", "--task", "toy", "--model", tiny_model,
             "--bucket", bucket, "--proxy", url], cwd=fork, env=env, stdout=logs["replica"],
            stderr=subprocess.STDOUT)
        trainer = subprocess.run(
            [py, "trainer.py", "--model", tiny_model, "--bucket", bucket, "--proxy", url,
             "--learning-rate", "1e-3", "--lora-r", "8", "--lora-alpha", "16",
             "--max-steps", str(STEPS)], cwd=fork, env=env, capture_output=True, text=True,
            timeout=300)
        # after the trainer's /done, the replica and the proxy exit by themselves
        codes = {r: p.wait(timeout=60) for r, p in procs.items()} if not trainer.returncode \
            else {}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        text = {}
        for r, f in logs.items():
            f.seek(0)
            text[r] = f.read()
            f.close()
    assert trainer.returncode == 0, trainer.stdout[-2000:] + trainer.stderr[-2000:]
    assert f"done: {STEPS} steps, last version v{STEPS}" in trainer.stdout, trainer.stdout
    assert codes == {"proxy": 0, "replica": 0}, text
    # one adapter version a step after v0, each a PEFT folder with its manifest, LATEST the last
    with open(os.path.join(bucket, "adapters", "LATEST")) as f:
        assert json.load(f)["version"] == STEPS
    for v in range(1, STEPS + 1):
        folder = os.path.join(bucket, "adapters", f"v{v:06d}")
        assert {"adapter_config.json", "adapter_model.safetensors", "manifest.json"} \
            <= set(os.listdir(folder)), folder
    steps = sorted(os.listdir(os.path.join(bucket, "metrics")))
    assert steps == [f"step-{s:06d}.json" for s in range(1, STEPS + 1)]


def test_a_fork_without_support_does_not_start(tmp_path):
    """The check above can fail: drop `support` from the list and the proxy dies on its
    import, before it listens (the trainer and the replica import support/ the same way)."""
    fork = str(tmp_path / "fork")
    make_fork([p for p in fork_list() if p != "support"], fork)
    r = subprocess.run([sys.executable, "proxy.py", "--port", str(free_port())], cwd=fork,
                       env=fork_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "No module named 'support'" in r.stderr, r.stderr[-2000:]


# ---- the variables table

def jobs_sh_defaults():
    """{"local": {VAR: default}, "hf": {VAR: default}}: the mode's values of support/defaults.py
    (what jobs.sh reads), and jobs.sh's own `${VAR:=default}` of the launch, the mode's block
    first, then those both modes share ($RUN read as runs/NAME)."""
    text = open(os.path.join(ROOT, "jobs.sh"), encoding="utf-8").read()
    start = text.index('if [ "$mode" = local ]; then')
    split = text.index("\nelse", start)
    end = text.index("\nfi\n", split)
    blocks = {"local": text[start:split], "hf": text[split:end], "both": text[end:]}
    found = {}
    for name, block in blocks.items():
        pairs = re.findall(r"\$\{(\w+):=((?:[^{}]|\{[^{}]*\})*)\}", block)
        found[name] = {var: value.replace("$RUN", "runs/NAME") for var, value in pairs}
    return {mode: {**found["both"], **found[mode], **values(mode)} for mode in ("local", "hf")}


def test_the_readme_variables_are_jobs_sh_defaults():
    lines = readme_section("Running")
    head = next(i for i, line in enumerate(lines) if line.startswith("| variable |"))
    table = itertools.takewhile(lambda line: line.startswith("|"), lines[head:])
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in table if line.startswith("| `")]
    assert len(rows) >= 10, "README's table of the variables you are most likely to change"
    defaults, checked = jobs_sh_defaults(), 0
    for names, local, hf, _ in rows:
        for mode, cell in (("local", local), ("hf", hf)):
            values = re.findall(r"`([^`]*)`", cell)
            if not values:  # a cell in words ("required", "–"): no default to compare
                continue
            for var, value in zip(re.findall(r"`(\w+)`", names), values, strict=True):
                assert defaults[mode].get(var) == value, (var, mode, value)
                checked += 1
    assert checked > len(rows), checked


# ---- "Your own task"

def test_the_own_task_example_makes_a_task_that_checks_out(tmp_path):
    """README's commands as written (HOME is a temporary folder; jobs.sh's run replaced by the
    task check jobs.sh runs before it starts anything, `python -m support.rewards`): 121 rows,
    the reward file imports, the check is on, and the function scores a right answer 1."""
    lines = readme_section("Running")
    start = lines.index("### Your own task")
    first = lines.index("```bash", start) + 1
    block = lines[first:lines.index("```", first)]
    script = "\n".join(block)
    assert script.count("bash jobs.sh --local") == 1
    check = ("bash -c '\"$0\" -m support.rewards --dataset \"$DATASET\" "
             "--reward-funcs $REWARD_FUNCS' ")
    script = script.replace("bash jobs.sh --local", check + shlex.quote(sys.executable))
    env = {**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(["bash", "-euc", script], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "108 train rows, 13 test rows; reward functions correct x1" in r.stdout, r.stdout
    assert "reward check: on" in r.stdout
    from support import rewards

    task = rewards.make_task({"dataset": str(tmp_path / "times" / "rows.jsonl"),
                              "reward_funcs": [f"{tmp_path / 'times' / 'reward.py'}:correct"]})
    row = task.rows("train")[0]
    got = task.score(row, [f"It is {row['answer']}.", "It is 1."], [[1], [2]], "r")[0]
    assert got == [1.0, 0.0]
