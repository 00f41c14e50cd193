"""Reward functions as TRL's GRPOTrainer calls them, and the task a run trains on (Task: a
dataset's rows and those functions), for the replica, the trainer's check and --eval alike.

    --reward-funcs path/to/file.py:reward [module:function ...] [--reward-weights 1.0 0.5 ...]

The calling convention (TRL's GRPOTrainer._calculate_rewards, read in TRL's source):

    f(prompts=[...], completions=[...], completion_ids=[[...]], **columns) -> list[float | None]

- one call per group: G completions of one prompt, `prompts` that prompt repeated G times;
- `completions`: the decoded texts (special tokens left out) for a plain-string prompt; for a
  conversational prompt (a list of messages) each is [{"role": "assistant", "content": text}];
- `completion_ids`: the sampled token ids, up to and including the first EOS;
- every other column of the dataset row by its name, as a list of G equal values;
- None means "does not apply" (NaN in TRL): the weighted sum skips it (TRL's nansum). A completion
  for which every function returned None has no reward (TRL masks it out of the group's
  baseline); here its group is dropped and reported, since a group carries one number per
  completion.

Departures from TRL, each a place where TRL would train on a number nobody chose: a function
that raises, returns another length, NaN, an infinity, |r| > REWARD_LIMIT (1e6) or anything but
a number (bool counts) or None is reported with its name and the row, and that group is dropped
and counted in the trainer's step (groups_dropped["reward_func_error"]); the run goes on
(RewardFuncError). TRL's extra keywords that are trainer objects (trainer_state,
log_extra, log_metric, environments) are not passed: a function that needs them cannot run here.

Deterministic functions are recomputed by the trainer (support/reward_check.py). One that is
not (an LLM judge, a sandbox with a clock) says so with an attribute in its file,
`reward.deterministic = False`; then the trainer does not check the run's rewards and says so.

This module imports no role file.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_own_task.py -q
"""

import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import sys

from support.contract import REWARD_LIMIT
from support.task_data import TEST_SPLIT_SIZE, DatasetError, load_splits
from support.tasks import BUILTIN, TaskError, load_task


class RewardFuncError(Exception):
    """A reward function that failed on one group: its name and the row, and what it did."""


def is_conversational(prompt):
    """TRL's test (trl.data_utils.is_conversational): a list of {"role", ...} messages."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) \
        and "role" in prompt[0]


def templated(tokenizer, prompt):
    """(text, ids) of a prompt as TRL's GRPOTrainer makes them (the engine's input).
    A conversational prompt through the chat template with the generation prompt, a plain
    string as it is (the tokenizer's own special tokens added: TRL calls
    processing_class(text=prompts))."""
    if not is_conversational(prompt):
        return prompt, tokenizer(prompt)["input_ids"]
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    else:  # a base model (TRL would stop here): the messages' text as it is
        text = "\n".join(m["content"] for m in prompt)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def as_completions(prompt, texts):
    """The `completions` argument: texts for a plain prompt, one assistant message each for a
    conversational one (TRL's form when the tokenizer has no response parser)."""
    if not is_conversational(prompt):
        return list(texts)
    return [[{"role": "assistant", "content": t}] for t in texts]


def checked_values(name, out, n, where):
    """One function's output as n floats or None; RewardFuncError naming what is wrong."""
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
        raise RewardFuncError(f"reward function {name} on {where} returned "
                              f"{type(out).__name__} {str(out)[:60]!r}, not a list of {n} rewards")
    if len(out) != n:
        raise RewardFuncError(f"reward function {name} on {where} returned {len(out)} rewards "
                              f"for {n} completions")
    values = []
    for j, r in enumerate(out):
        ok = r is None or (isinstance(r, numbers.Real) and math.isfinite(r)
                           and abs(r) <= REWARD_LIMIT)
        if not ok:
            raise RewardFuncError(f"reward function {name} on {where}, completion {j}: "
                                  f"{str(r)[:60]!r} ({type(r).__name__}) is not a finite number "
                                  f"within +-{REWARD_LIMIT:g} or None")
        values.append(None if r is None else float(r))
    return values


class Task:
    """What a run trains on: the dataset's rows per split and the reward functions (with their
    weights). `name` labels logs and files; `rows(split)` loads once."""

    def __init__(self, name, splits, funcs, weights=None):
        self.name, self.splits, self.funcs = name, splits, funcs
        self.weights = list(weights) if weights else [1.0] * len(funcs)
        self.loaded = {}
        if len(self.weights) != len(funcs):
            raise TaskError(f"--reward-weights: {len(self.weights)} weights for {len(funcs)} "
                            "reward functions (one each, as TRL's reward_weights)")
        self.deterministic = all(getattr(fn, "deterministic", True) for _, fn in funcs)

    def rows(self, split):
        if split not in self.loaded:
            self.loaded[split] = self.splits(split)
        return self.loaded[split]

    def fingerprint(self):
        """The reward functions and weights as a string (the eval cache's key)."""
        return json.dumps([[n, reward_source(fn)] for n, fn in self.funcs] + [self.weights])

    def score(self, row, texts, ids, where):
        """(rewards, per_function): the reward functions on G completions, TRL's weighted sum.
        Of G completions of one row: rewards[j] the weighted sum of the functions' values that are
        not None (TRL's nansum), per_function[k][j] function k's value. RewardFuncError names the
        function and `where` (the row) when one misbehaves."""
        prompt = row["prompt"]
        columns = {k: [v] * len(texts) for k, v in row.items()
                   if k not in ("prompt", "completion", "completion_ids")}
        per_function = []
        for name, fn in self.funcs:
            try:
                out = fn(prompts=[prompt] * len(texts), completions=as_completions(prompt, texts),
                         completion_ids=[list(x) for x in ids], **columns)
            except RewardFuncError:
                raise
            except Exception as e:
                raise RewardFuncError(f"reward function {name} on {where} raised "
                                      f"{type(e).__name__}: {str(e)[:200]}") from None
            per_function.append(checked_values(name, out, len(texts), where))
        rewards = []
        for j in range(len(texts)):
            got = [(w, v[j]) for w, v in zip(self.weights, per_function) if v[j] is not None]
            if not got:
                raise RewardFuncError(f"every reward function returned None for {where}, "
                                      f"completion {j}: no reward (TRL leaves it out of the "
                                      "group's mean); the group is dropped")
            total = sum(w * v for w, v in got)
            if not abs(total) <= REWARD_LIMIT:
                raise RewardFuncError(f"the weighted sum for {where}, completion {j}, is {total:g},"
                                      f" beyond +-{REWARD_LIMIT:g}: lower --reward-weights")
            rewards.append(total)
        return rewards, per_function


TASKS = {}  # make_task's, by its arguments: one load per process (trainer_args, then the check)


def make_task(spec, data=None, say=print):
    """The Task of a run's flags (task_spec: task, dataset, reward_funcs, ...).
    Everything that can be checked without a model is checked here, before anything starts: the
    functions import, the train split loads and every prompt is usable. TaskError says what to
    fix."""
    key = json.dumps([spec, data], sort_keys=True)
    if key not in TASKS:
        TASKS[key] = new_task(spec or {}, data, say)
    return TASKS[key]


def new_task(spec, data, say):
    task, dataset, funcs = spec.get("task"), spec.get("dataset"), spec.get("reward_funcs")
    if task and task not in BUILTIN:
        raise TaskError(f"unknown task {task!r}: use {', '.join(BUILTIN)}, or --dataset with "
                        "--reward-funcs for your own")
    if not task and not dataset:
        raise TaskError("no task: give --task (" + ", ".join(BUILTIN) + ") or --dataset with "
                        "--reward-funcs")
    if dataset and not funcs:
        raise TaskError(f"--dataset {dataset} needs --reward-funcs (path/to/file.py:function "
                        "or module:function): a dataset carries no reward")
    if dataset:
        cache = {}

        def splits(split):  # both at once: the test split may be cut from the train one
            if not cache:
                try:
                    cache.update(load_splits(
                        dataset, spec.get("dataset_config"),
                        spec.get("dataset_train_split") or "train",
                        spec.get("dataset_test_split") or "test",
                        spec.get("test_split_size") or TEST_SPLIT_SIZE, spec.get("eval_dataset"),
                        say))
                except DatasetError as e:
                    raise TaskError(str(e)) from None
            return cache[split]
        name = os.path.splitext(os.path.basename(dataset.rstrip("/")))[0] or dataset
    else:
        def splits(split):
            return load_task(task, split, data)
        name = task
    loaded = load_reward_funcs(funcs) if funcs else [(BUILTIN[task].__name__, BUILTIN[task])]
    result = Task(name, splits, loaded, spec.get("reward_weights"))
    result.rows("train")  # refused here, not at the first group
    return result


def add_task_flags(p, default_task=None):
    """The task flags, the same for the replica, the trainer's check and `python -m
    support.rewards`: a built-in --task, or your own --dataset and --reward-funcs (TRL's names
    and convention: support/rewards.py, support/task_data.py)."""
    a = p.add_argument
    a("--task", choices=list(BUILTIN), help="a built-in task: its rows and reward function "
      "(support/tasks.py)" + (f"; {default_task} when neither --task nor --dataset is given"
                              if default_task else ""))
    a("--data", help="--task gsm8k, math: a folder with train.jsonl/test.jsonl, or one JSONL file "
      "(split as --dataset is; default: the hub)")
    a("--dataset", help="your own task's rows (TRL's dataset_name): a .jsonl/.json/.parquet file, "
      "a folder of split files or a Hub dataset id; a 'prompt' column (a string or chat "
      "messages), other columns go to the reward functions by name")
    a("--dataset-config", help="the Hub dataset's config name (TRL's dataset_config)")
    a("--dataset-train-split", default="train", help="the split trained on (TRL's name)")
    a("--dataset-test-split", default="test",
      help="the held-out split --eval scores (TRL's name); absent: see --test-split-size")
    a("--test-split-size", type=float, default=TEST_SPLIT_SIZE,
      help="a dataset without the test split: this share of the train split is held out "
      "(datasets' train_test_split, seed 0; TRL's test_split_size)")
    a("--eval-dataset", help="a file of held-out rows, instead of --test-split-size")
    a("--reward-funcs", nargs="+", metavar="FILE.py:FUNC",
      help="reward functions, path/to/file.py:function or module:function (TRL's reward_funcs), "
      "called f(prompts, completions, completion_ids, **columns) -> list[float | None]; "
      "default: --task's")
    a("--reward-weights", nargs="+", type=float,
      help="one weight per reward function (TRL's reward_weights; default: 1 each)")


TASK_FLAGS = ("task", "dataset", "dataset_config", "dataset_train_split", "dataset_test_split",
              "test_split_size", "eval_dataset", "reward_funcs", "reward_weights")


def task_spec(args, default_task=None):
    """The task flags as one JSON-able dict (support/rewards.py's make_task takes it), or None
    when none names a task. TaskError when --task and --dataset are both given."""
    if args.task and args.dataset:
        raise TaskError(f"--task {args.task} and --dataset {args.dataset}: give one (--task with "
                        "--reward-funcs keeps its rows and uses your functions)")
    task = args.task or (None if args.dataset else default_task)
    if not task and not args.dataset:
        return None
    return {**{k: getattr(args, k) for k in TASK_FLAGS}, "task": task}


# ---- your own reward functions (--reward-funcs), loaded from a file or a module; a built-in
# task's (--task arith) are support/tasks.py's

def load_reward_funcs(specs):
    """[(name, function)] for `path/to/file.py:function` or `module:function` (TRL's dotted
    `module.function` too). Raises TaskError, before anything starts, for a file or module that
    does not import or lacks the function."""
    funcs = []
    for spec in specs:
        where, sep, name = spec.rpartition(":")
        if not sep and "." in spec and not spec.endswith(".py"):  # TRL's my_lib.rewards.func
            where, _, name = spec.rpartition(".")
        if not where or not name:
            raise TaskError(f"--reward-funcs {spec}: use path/to/file.py:function or "
                            "module:function")
        try:
            module = import_rewards(where)
        except TaskError as e:
            raise TaskError(f"--reward-funcs {spec}: {e}") from None
        except (Exception, SystemExit) as e:  # SyntaxError, ImportError, a raise at import
            raise TaskError(f"--reward-funcs {spec}: {where} does not import "
                            f"({type(e).__name__}: {str(e)[:300]}): fix the file or the module "
                            "path") from None
        fn = getattr(module, name, None)
        if not callable(fn):
            defined = [n for n, v in vars(module).items() if inspect.isfunction(v)
                       and not n.startswith("_")][:10]
            raise TaskError(f"--reward-funcs {spec}: {where} has no function {name!r} (its "
                            f"functions: {defined})")
        funcs.append((name, fn))
    return funcs


def import_rewards(where):
    """The module of a --reward-funcs entry: a .py file, imported as a module of its own under a
    name nothing else uses (its names never meet the package's: a `last_number` of its own
    leaves support.tasks's alone), or an importable module path."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    if not os.path.isfile(where):
        raise TaskError(f"no file {where} (a path from the current directory, {os.getcwd()})")
    key = hashlib.sha256(os.path.abspath(where).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(f"reward_file_{key}", where)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def reward_source(fn):
    """What identifies a function's code for the eval cache: its file's bytes, else its name."""
    try:
        with open(inspect.getsourcefile(fn), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except (TypeError, OSError):
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def main(argv=None):
    """python -m support.rewards TASK-FLAGS: check a task before a run (jobs.sh does): the
    functions import, both splits load; one line each, exit 1 with what to fix."""
    import argparse

    p = argparse.ArgumentParser(description="Check a task before a run: the reward functions "
                                "import, the dataset's splits load, every prompt is usable.")
    add_task_flags(p)
    args = p.parse_args(argv)
    try:
        task = make_task(task_spec(args), args.data)  # no task: TaskError
        test = task.rows("test")
    except TaskError as e:
        sys.exit(f"task check: error: {e}")
    names = ", ".join(f"{n} x{w:g}" for (n, _), w in zip(task.funcs, task.weights))
    print(f"task {task.name}: {len(task.rows('train'))} train rows, {len(test)} test rows; "
          f"reward functions {names}")
    print("reward check: " + ("on (the trainer recomputes every reward with these functions)"
                              if task.deterministic else "off (a reward function is marked "
                              "deterministic = False: the trainer trusts the replicas' rewards)"))


if __name__ == "__main__":
    main()
