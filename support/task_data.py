"""A dataset as TRL's GRPOTrainer takes one: rows with a "prompt" column (a string, or a list of
chat messages {"role", "content"}) and any other columns, which the reward functions receive by
name (support/rewards.py).

    --dataset data.jsonl           a local JSONL, JSON or Parquet file (its rows: one split)
    --dataset FOLDER               files named by split (train.jsonl, test.parquet, ...)
    --dataset openai/gsm8k --dataset-config main      a Hub dataset (TRL's flag names)

All three go through datasets.load_dataset, as TRL's script does. The train split is
--dataset-train-split ("train"), the held-out one --dataset-test-split ("test"). A dataset with
no such test split is split by one stated rule: --eval-dataset FILE when given, else
--test-split-size (0.1) of the train split held out by datasets' train_test_split with seed 0
(TRL's script splits without a seed; here the replica, the trainer and --eval must agree on
every row). The split is printed.

This module imports no role file.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_own_task.py -q -k dataset
"""

import os

SPLIT_SEED = 0  # train_test_split's seed: the same split in every role and every run
TEST_SPLIT_SIZE = 0.1  # the share held out when a dataset has no test split
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # datasets' builder names


class DatasetError(ValueError):
    """A dataset a run cannot use; the message says what to fix."""


def load_splits(dataset, config=None, train_split="train", test_split="test",
                test_split_size=TEST_SPLIT_SIZE, eval_dataset=None, say=print, check=True):
    """{"train": rows, "test": rows} of a dataset (module docstring), each row a dict. Raises
    DatasetError for one that cannot load, lacks the train split or (check) has a row without a
    usable prompt (a built-in task's --data has its own columns: check=False)."""
    parts = load(dataset, config)
    if train_split not in parts:
        raise DatasetError(f"--dataset {dataset} has no split {train_split!r} (it has "
                           f"{sorted(parts)}): set --dataset-train-split")
    train = parts[train_split]
    if eval_dataset:
        test, how = load(eval_dataset, None)["train"], f"its test rows are {eval_dataset}"
    elif test_split in parts:
        test, how = parts[test_split], f"the test rows are its {test_split!r} split"
    else:
        halves = train.train_test_split(test_size=test_split_size, seed=SPLIT_SEED)
        train, test = halves["train"], halves["test"]
        how = (f"no {test_split!r} split, so --test-split-size {test_split_size:g} of "
               f"{train_split!r} is held out (datasets' train_test_split, seed {SPLIT_SEED})")
    say(f"dataset {dataset}: {how}: {len(train)} train rows, {len(test)} test rows")
    if not check:
        return {"train": train.to_list(), "test": test.to_list()}
    return {"train": checked(train, dataset, "train"), "test": checked(test, dataset, "test")}


def load(dataset, config):
    """datasets.load_dataset's DatasetDict of a local file, a local folder or a Hub id."""
    import datasets

    datasets.disable_progress_bars()  # no bars in the roles' logs
    ext = os.path.splitext(dataset)[1].lower()
    try:
        if os.path.isfile(dataset):
            if ext not in FORMATS:
                raise DatasetError(f"--dataset {dataset}: a local file is .jsonl, .json or "
                                   ".parquet (or give a folder, or a Hub dataset id)")
            return datasets.load_dataset(FORMATS[ext], data_files=dataset)
        return datasets.load_dataset(dataset, config)  # a folder of split files, or the Hub
    except DatasetError:
        raise
    except Exception as e:  # not found, offline, a bad config, a malformed file
        why = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise DatasetError(f"--dataset {dataset} does not load ({type(e).__name__}: {why}): give "
                           "a local .jsonl/.parquet file or folder, or a Hub dataset id (and "
                           "--dataset-config) this machine can reach") from None


def checked(split, dataset, name):
    """A split's rows as dicts, each with a prompt TRL takes: a non-empty string, or a list of
    {"role", "content"} messages."""
    if "prompt" not in split.column_names:
        raise DatasetError(f"--dataset {dataset} has no 'prompt' column in its {name} split (its "
                           f"columns: {split.column_names[:12]}): TRL's GRPOTrainer reads each "
                           "prompt from 'prompt'; rename yours, e.g. "
                           "dataset.rename_column('question', 'prompt')")
    rows = split.to_list()
    if not rows:
        raise DatasetError(f"--dataset {dataset}: the {name} split has no rows")
    for i, row in enumerate(rows):
        if prompt_problem(row["prompt"]):
            raise DatasetError(f"--dataset {dataset}, {name} row {i}: the prompt must be a "
                               "non-empty string or a list of {'role', 'content'} messages, not "
                               f"{str(row['prompt'])[:80]!r}")
    return rows


def prompt_problem(prompt):
    """True when `prompt` is neither a non-empty string nor a list of chat messages."""
    if isinstance(prompt, str):
        return not prompt
    return not (isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt))
