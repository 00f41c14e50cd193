"""Your own task, taken the way TRL takes it (issue 51): a dataset with a "prompt" column and
reward functions f(prompts, completions, completion_ids, **columns) -> list[float | None], given
as --dataset and --reward-funcs to the replica, the trainer's check and --eval alike.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_own_task.py -q

The runs are real processes on 127.0.0.1 (proxy.py, rollout.py --engine hf, trainer.py) on the
tiny model, with the dataset and the reward file written into an empty folder outside the
repository (tmp_path), as a user's would be.
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest

from support import buckets, rewards, task_data, tasks
from conftest import ROOT, free_port, wait_port
from test_jobs_hf import dry_run_commands, gateway, run_jobs  # noqa: F401  (gateway: autouse)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
       "PROXY_TOKEN": "t"}

# TRL's documented form (docs "Using a custom reward function": def reward_func(completions,
# ground_truth, **kwargs)), with this dataset's column: 1 when the answer is in the completion
PLAIN_REWARD = """\
def reward(completions, answer, **kwargs):
    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]
"""
# conversational rows: each completion is [{"role": "assistant", "content": ...}]; a TRL reward in
# [-1, 1] (the old contract refused anything outside [0, 1]); each call leaves its process's id
CHAT_REWARD = """\
import os


def reward(completions, answer, **kwargs):
    with open(os.path.join(os.path.dirname(__file__), "calls.txt"), "a") as f:
        f.write(f"{os.getpid()}\\n")
    return [1.0 if a in c[0]["content"] else -1.0 for c, a in zip(completions, answer)]
"""


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def digit_rows(conversational=False, n=40):
    """n prompts asking for a digit; the reward wants a 7 (the tiny model writes one in ~6%)."""
    prompts = [f"Say a digit. ({i})" for i in range(n)]
    return [{"prompt": [{"role": "user", "content": p}] if conversational else p, "answer": "7",
             "id": i} for i, p in enumerate(prompts)]


def run_roles(tmp_path, tiny_model, task_flags, steps=20, proxy_flags=()):
    """proxy.py, one rollout.py and trainer.py with these task flags, until the trainer's last
    step. Returns (trainer's stdout, replica's log, the step records)."""
    port, bucket = free_port(), str(tmp_path / "bucket")
    url = f"http://127.0.0.1:{port}"
    proxy = subprocess.Popen([sys.executable, "proxy.py", "--port", str(port), "--linger", "10",
                              "--num-generations", "8", "--groups-per-step", "4",
                              "--max-staleness", "2", "--max-completion-length", "6",
                              *proxy_flags], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    replica = None
    try:
        wait_port(port)
        log = open(tmp_path / "replica.log", "w")
        replica = subprocess.Popen([sys.executable, "rollout.py", "--engine", "hf", "--model",
                                    tiny_model, "--bucket", bucket, "--proxy", url, *task_flags],
                                   cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        r = subprocess.run([sys.executable, "trainer.py", "--model", tiny_model, "--bucket", bucket,
                            "--proxy", url, "--lora-r", "8", "--lora-alpha", "16",
                            "--learning-rate", "5e-3", "--max-steps", str(steps),
                            "--wait-timeout", "120", *task_flags], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        replica.wait(timeout=60)
        return r.stdout + r.stderr, (tmp_path / "replica.log").read_text(), \
            buckets.read_metrics(bucket)
    finally:
        for p in (replica, proxy):
            if p and p.poll() is None:
                p.kill()
                p.wait()


def rising(metrics):
    """The mean reward of the first and the last 5 steps."""
    r = [m["reward_mean"] for m in metrics]
    return sum(r[:5]) / 5, sum(r[-5:]) / 5


def test_a_trl_dataset_and_reward_file_train_and_the_trainer_checks_them(tiny_model, tmp_path):
    """A JSONL with plain-string prompts and TRL's reward form, in a folder of its own: the run
    learns (mean reward rising), the trainer recomputes every reward with the same function
    (nothing dropped), and --eval scores the held-out rows (split by the stated rule, printed)."""
    data = write_rows(tmp_path / "rows.jsonl", digit_rows())
    (tmp_path / "my_reward.py").write_text(PLAIN_REWARD)
    flags = ["--dataset", data, "--reward-funcs", f"{tmp_path / 'my_reward.py'}:reward"]
    out, replica_log, metrics = run_roles(tmp_path, tiny_model, flags)
    assert "reward check: on (rows, 36 train rows, reward)" in out, out[:2000]
    assert "no 'test' split, so --test-split-size 0.1 of 'train' is held out" in out
    assert [m["step"] for m in metrics] == list(range(1, 21))
    assert all(not m["groups_dropped"] for m in metrics), [m["groups_dropped"] for m in metrics]
    first, last = rising(metrics)
    print(f"own task: mean reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last > first + 0.3, (first, last)
    # the held-out rows, greedy, scored by the same function: accuracy (it returns 0 or 1)
    r = subprocess.run([sys.executable, "rollout.py", "--eval", "--engine", "hf", "--model",
                        tiny_model, "--bucket", str(tmp_path / "bucket"), "--adapter", "latest",
                        "--eval-out", str(tmp_path / "eval.json"), *flags], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.load(open(tmp_path / "eval.json"))
    assert result["n"] == 4 and result["reward_funcs"] == ["reward"]
    assert result["accuracy"] == result["mean_reward"] and "accuracy" in r.stdout
    trained = {row["prompt"] for row in rewards.make_task(
        {"dataset": data, "reward_funcs": [f"{tmp_path / 'my_reward.py'}:reward"]}).rows("train")}
    assert not trained & {x["prompt"] for x in result["results"]}  # held out: never trained on


def test_a_conversational_dataset_with_rewards_in_minus_one_one(tiny_model, tmp_path):
    """Chat-message prompts (templated as TRL does), completions handed over as messages, and a
    reward of -1 or 1: the proxy's default reward_range takes it (the old [0, 1] refused every
    group), the run learns, and both the replica and the trainer called the function."""
    data = write_rows(tmp_path / "chat.jsonl", digit_rows(conversational=True))
    (tmp_path / "chat_reward.py").write_text(CHAT_REWARD)
    flags = ["--dataset", data, "--reward-funcs", f"{tmp_path / 'chat_reward.py'}:reward"]
    out, replica_log, metrics = run_roles(tmp_path, tiny_model, flags)
    assert all(not m["groups_dropped"] for m in metrics)
    rewards_seen = {c for m in metrics for c in (m["reward_mean"],)}
    assert min(rewards_seen) < 0, "rewards of -1 went through the proxy"
    first, last = rising(metrics)
    print(f"conversational: mean reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last > first + 0.5, (first, last)
    callers = set((tmp_path / "calls.txt").read_text().split())
    assert len(callers) == 2, "the replica and the trainer each call the reward function"
    # the prompt the replica sent is the chat template's, as TRL makes it
    from transformers import AutoTokenizer

    text, _ = rewards.templated(AutoTokenizer.from_pretrained(tiny_model),
                                [{"role": "user", "content": "Say a digit. (3)"}])
    assert text == "<|im_start|>user\nSay a digit. (3)<|im_end|>\n<|im_start|>assistant\n"


# ---- the calling convention (support/rewards.py), against TRL's _calculate_rewards

def test_the_convention_passes_what_trl_passes():
    seen = []

    def spy(prompts, completions, completion_ids, **columns):
        seen.append((prompts, completions, completion_ids, columns))
        return [0.5, None]

    def other(completions, **kwargs):
        return [1.0, 2.0]

    task = rewards.Task("t", lambda s: [], [("spy", spy), ("other", other)], [2.0, 0.5])
    row = {"prompt": "2 + 2 =", "answer": "4", "level": 3}
    got, per = task.score(row, ["4", "5"], [[7, 0], [8, 0]], "train row 0")
    assert seen == [(["2 + 2 ="] * 2, ["4", "5"], [[7, 0], [8, 0]],
                     {"answer": ["4", "4"], "level": [3, 3]})]
    # None is skipped in the weighted sum (TRL's nansum): 2 * 0.5 + 0.5 * 1, then 0.5 * 2 alone
    assert got == [1.5, 1.0] and per == [[0.5, None], [1.0, 2.0]]
    chat = {"prompt": [{"role": "user", "content": "2 + 2?"}], "answer": "4"}
    task.score(chat, ["4", "5"], [[1], [2]], "train row 1")
    assert seen[-1][1] == [[{"role": "assistant", "content": "4"}],
                           [{"role": "assistant", "content": "5"}]]


def plain(value):
    return lambda completions, **kw: value(completions)


@pytest.mark.parametrize("fn, says", [
    (plain(lambda c: 1 / 0), "reward function bad on train row 7 raised ZeroDivisionError"),
    (plain(lambda c: [1.0]), "reward function bad on train row 7 returned 1 rewards for 2"),
    (plain(lambda c: [1.0, math.nan]), "completion 1: 'nan' (float) is not a finite number"),
    (plain(lambda c: ["1.0", 1.0]), "completion 0: '1.0' (str) is not a finite number"),
    (plain(lambda c: [1e300, 0.0]), "completion 0: '1e+300' (float) is not a finite number"),
    (plain(lambda c: "1.0"), "returned str '1.0', not a list of 2 rewards"),
    (plain(lambda c: [None, None]), "every reward function returned None for train row 7"),
])
def test_a_bad_reward_function_is_named_with_its_row(fn, says):
    task = rewards.Task("t", lambda s: [], [("bad", fn)])
    with pytest.raises(rewards.RewardFuncError, match=re.escape(says)):
        task.score({"prompt": "p"}, ["a", "b"], [[1], [2]], "train row 7")


BAD_REWARD = """\
import math


def reward(completions, mode, **kwargs):
    m = mode[0]
    if m == "raise":
        raise KeyError("no such thing")
    return {"short": [1.0], "nan": [math.nan] * len(completions), "string": ["x"] * len(completions),
            "huge": [1e12] * len(completions)}.get(m, [float("7" in c) for c in completions])
"""


def test_bad_reward_functions_lose_nothing_the_run_goes_on(tiny_model, tmp_path):
    """A function that raises, returns the wrong length, NaN, a string or a huge value on some
    rows: each such group is reported by the replica with the function's name and the row, and
    dropped; every other group trains, and the trainer finishes its steps. A row whose prompt is
    over the run's max_prompt_length is skipped, said once."""
    modes = ["raise", "short", "nan", "string", "huge"]
    rows = [{"prompt": f"Say a digit. ({i})", "mode": modes[i] if i < 5 else "ok"}
            for i in range(10)] + [{"prompt": "Say a digit. " + "x" * 100, "mode": "ok"}]
    data = write_rows(tmp_path / "rows.jsonl", rows)
    (tmp_path / "bad.py").write_text(BAD_REWARD)
    flags = ["--dataset", data, "--eval-dataset", data,  # every row trained on
             "--reward-funcs", f"{tmp_path / 'bad.py'}:reward"]
    out, log, metrics = run_roles(tmp_path, tiny_model, flags, steps=6,
                                  proxy_flags=["--max-prompt-length", "80"])
    assert [m["step"] for m in metrics] == list(range(1, 7))
    # the replica's drops reach the trainer's step metrics (through the proxy, with the batches)
    counted = sum(m["groups_dropped"].get("reward_func_error", 0) for m in metrics)
    assert 1 <= counted <= log.count("group dropped"), ([m["groups_dropped"] for m in metrics],
                                                        log.count("group dropped"))
    assert re.search(r"\(\d+ all-equal, [1-9]\d* dropped\)", out), out[-2000:]  # the step's line
    for says in ("raised KeyError: 'no such thing'", "returned 1 rewards for 8 completions",
                 "'nan' (float) is not a finite", "'x' (str) is not a finite",
                 "'1000000000000.0' (float) is not a finite"):
        assert "group dropped" in log and "reward function reward on train row" in log
        assert says in log, (says, log[-3000:])
    assert "dataset" in out and "11 train rows" in out
    # a prompt longer than the run allows: skipped by the replica (the proxy would refuse it)
    assert "train row 10 skipped: its prompt has 113 tokens, over the run's max_prompt_length 80" \
        in log, log[-3000:]


# ---- refused before anything starts, with what to fix

def check(*flags):
    """python -m support.rewards: the task check jobs.sh runs before it starts a process."""
    return subprocess.run([sys.executable, "-m", "support.rewards", *flags], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("reward_file, spec, says", [
    ("def reward(completions, **kw):\n    return [1.0 for _ in completions\n", "reward",
     "does not import (SyntaxError"),
    ("import no_such_module_here\n", "reward", "does not import (ModuleNotFoundError"),
    ("def score(completions, **kw):\n    return [1.0]\n", "reward",
     "has no function 'reward' (its functions: ['score'])"),
])
def test_a_reward_file_that_cannot_run_is_refused_before_start(tmp_path, tiny_model, reward_file,
                                                                spec, says):
    data = write_rows(tmp_path / "rows.jsonl", digit_rows(n=10))
    (tmp_path / "r.py").write_text(reward_file)
    flags = ["--dataset", data, "--reward-funcs", f"{tmp_path / 'r.py'}:{spec}"]
    r = check(*flags)
    assert r.returncode == 1 and says in r.stderr, r.stderr[-2000:]
    # the roles refuse it the same way, before they contact a proxy (none listens here)
    for role in (["rollout.py", "--bucket", str(tmp_path), "--proxy", "http://127.0.0.1:9"],
                 ["trainer.py", "--bucket", str(tmp_path), "--proxy", "http://127.0.0.1:9"]):
        r = subprocess.run([sys.executable, *role, "--model", tiny_model, *flags], cwd=ROOT,
                           env=ENV, capture_output=True, text=True, timeout=120)
        line = r.stderr.strip().splitlines()[-1]
        assert r.returncode != 0 and line.startswith(f"{role[0]}: error: --reward-funcs"), line
        assert says in line, line


def test_a_dataset_without_a_prompt_column_is_refused_before_start(tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", [{"question": "1 + 1?", "answer": "2"}] * 5)
    (tmp_path / "r.py").write_text(PLAIN_REWARD)
    r = check("--dataset", data, "--reward-funcs", f"{tmp_path / 'r.py'}:reward")
    assert r.returncode == 1, r.stderr
    assert "has no 'prompt' column in its train split (its columns: ['question', 'answer'])" \
        in r.stderr and "rename_column('question', 'prompt')" in r.stderr
    bad = write_rows(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": [{"text": "hi"}]}])
    r = check("--dataset", bad, "--reward-funcs", f"{tmp_path / 'r.py'}:reward",
              "--eval-dataset", bad)
    assert r.returncode == 1 and "train row 1: the prompt must be" in r.stderr, r.stderr


def test_unknown_tasks_and_missing_rewards_stop_everything():
    """Issue 51: an unknown task name fell back to the arith reward in every role. Now a task is
    its functions: an unknown name, a dataset without functions or both --task and --dataset are
    refused with what to give."""
    with pytest.raises(tasks.TaskError, match="unknown task 'arithmetic': use arith, gsm8k"):
        rewards.make_task({"task": "arithmetic"})
    with pytest.raises(tasks.TaskError, match="needs --reward-funcs"):
        rewards.make_task({"dataset": "rows.jsonl"})
    assert set(tasks.BUILTIN) == {"arith", "gsm8k", "math", "toy"}  # --task's choices
    r = check("--task", "arith", "--dataset", "rows.jsonl")
    assert r.returncode == 1 and "give one" in r.stderr
    r = check("--task", "arith")
    assert r.returncode == 0 and "reward functions number_reward x1" in r.stdout, r.stderr
    assert "reward check: on" in r.stdout


def test_a_reward_file_has_its_own_names(tmp_path):
    """Issue 51: a reward pasted next to the package's own last_number (same name, another return
    type) made every reward 0. A reward file is a module of its own: its last_number is its own,
    the package's is untouched, and --task arith's rows take your function."""
    (tmp_path / "mine.py").write_text(
        "def last_number(text):\n    return text.split()[-1]  # a string, not a float\n\n"
        "def reward(completions, answer, **kwargs):\n"
        "    return [float(last_number(c[0]['content']) == a) for c, a in zip(completions, answer)]\n")
    task = rewards.make_task({"task": "arith", "reward_funcs": [f"{tmp_path / 'mine.py'}:reward"]})
    row = task.rows("train")[0]
    assert task.score(row, [f"it is {row['answer']}", "it is 0"], [[1], [2]], "r")[0] == [1.0, 0.0]
    assert tasks.last_number("it is 41") == 41.0 and tasks.number_reward(["41"], ["41"]) == [1.0]
    assert "last_number" not in dir(rewards) and tasks.last_number.__module__ == "support.tasks"


def test_the_split_rule_and_a_folder_of_splits(tmp_path):
    """One file: test_split_size held out by datasets' train_test_split with seed 0, the same in
    every process; a folder with train and test files: its own splits (datasets' rule, as for a
    Hub dataset); --dataset-test-split names another one."""
    data = write_rows(tmp_path / "all.jsonl", digit_rows(n=50))
    said = []
    parts = task_data.load_splits(data, say=said.append)
    assert (len(parts["train"]), len(parts["test"])) == (45, 5) and "seed 0" in said[0]
    assert task_data.load_splits(data, say=said.append) == parts
    assert len(task_data.load_splits(data, test_split_size=0.2, say=said.append)["test"]) == 10
    folder = tmp_path / "splits"
    folder.mkdir()
    write_rows(folder / "train.jsonl", digit_rows(n=6))
    write_rows(folder / "validation.jsonl", digit_rows(n=2))
    parts = task_data.load_splits(str(folder), test_split="validation", say=said.append)
    assert (len(parts["train"]), len(parts["test"])) == (6, 2)
    assert "its 'validation' split" in said[-1]
    pq = tmp_path / "rows.parquet"
    import datasets

    datasets.Dataset.from_list(digit_rows(n=20)).to_parquet(str(pq))
    assert len(task_data.load_splits(str(pq), say=said.append)["test"]) == 2
    with pytest.raises(task_data.DatasetError, match="does not load"):
        task_data.load_splits("nobody/no-such-dataset-here", say=said.append)


# ---- jobs.sh: DATASET, REWARD_FUNCS, REWARD_WEIGHTS, EVAL_DATA

def test_jobs_sh_local_runs_your_own_task(tiny_model, tmp_path):
    """`bash jobs.sh --local` with DATASET and REWARD_FUNCS pointing into a folder of their own:
    the task is checked before anything starts (the reward check's on/off on the console), the
    run learns, and both evaluations score the held-out rows with the same function."""
    import shutil
    import uuid

    data = write_rows(tmp_path / "rows.jsonl", digit_rows(conversational=True))
    (tmp_path / "my_reward.py").write_text(PLAIN_REWARD.replace("a in c", "a in c[0]['content']"))
    name = f"test-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, NAME=name, MODEL=tiny_model, DATASET=data, STEPS="20",
               REWARD_FUNCS=f"{tmp_path / 'my_reward.py'}:reward", REPLICAS="1",
               MAX_STALENESS="2", NUM_GENERATIONS="8", GROUPS_PER_STEP="4",
               MAX_COMPLETION_LENGTH="6", LEARNING_RATE="5e-3", LORA_R="8", LORA_ALPHA="16",
               EVAL_LIMIT="0", ENGINE="hf", PROXY_PORT=str(free_port()), HF_HUB_OFFLINE="1")
    run = os.path.join(ROOT, "runs", name)
    try:
        r = subprocess.run(["bash", "jobs.sh", "--local"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        out = r.stdout
        assert "task rows: 36 train rows, 4 test rows; reward functions reward x1" in out, out
        assert "reward check: on" in out and out.index("reward check: on") < out.index("== proxy")
        first, last = rising(buckets.read_metrics(os.path.join(run, "bucket")))
        print(f"jobs.sh --local, own task: mean reward {first:.3f} -> {last:.3f}")
        assert last > first + 0.3, (first, last)
        final = json.load(open(os.path.join(run, "eval-final.json")))
        assert final["task"] == "rows" and final["n"] == 4 and "accuracy" in final
    finally:
        shutil.rmtree(run, ignore_errors=True)


def test_jobs_sh_refuses_a_bad_task_before_anything_starts(tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", digit_rows(n=10))
    (tmp_path / "r.py").write_text("def reward(completions, **kw)\n")
    env = dict(os.environ, NAME="test-bad-task", DATASET=data, PROXY_PORT=str(free_port()),
               REWARD_FUNCS=f"{tmp_path / 'r.py'}:reward", HF_HUB_OFFLINE="1")
    r = subprocess.run(["bash", "jobs.sh", "--local"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1 and "does not import (SyntaxError" in r.stderr, r.stderr[-2000:]
    assert "the task above cannot run (nothing was started)" in r.stderr
    assert "== proxy" not in r.stdout
    import shutil

    shutil.rmtree(os.path.join(ROOT, "runs", "test-bad-task"), ignore_errors=True)


def test_on_jobs_the_reward_file_and_the_data_travel_with_the_code(tmp_path, hf_run_name):
    """DRY_RUN=1 on Hugging Face Jobs: the local dataset and reward file are copied into the
    uploaded code folder and the jobs are given their /code paths; the weights pass as they are."""
    data = write_rows(tmp_path / "rows.jsonl", digit_rows(n=10))
    (tmp_path / "my_reward.py").write_text(PLAIN_REWARD)
    res, calls = run_jobs(tmp_path, NAME=hf_run_name, BUCKET="me/b", DRY_RUN="1", DATASET=data,
                          REWARD_FUNCS=f"{tmp_path / 'my_reward.py'}:reward support.tasks:"
                          "seven_reward", REWARD_WEIGHTS="1.0 0.5")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "reward check: on" in res.stdout
    code = os.path.join(ROOT, "runs", hf_run_name, "code", "own_task")
    assert sorted(os.listdir(code)) == ["my_reward.py", "rows.jsonl"]
    commands = dry_run_commands(res)
    for cmd in commands[1:]:  # the replica and the trainer
        line = cmd[-1]
        assert "--dataset /code/own_task/rows.jsonl" in line, line
        assert ("--reward-funcs /code/own_task/my_reward.py:reward support.tasks:seven_reward "
                "--reward-weights 1.0 0.5") in line, line
    assert calls == []
