"""Rewards, task splits and sharding of rollout.py: pure functions, no model.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_rewards.py -q

GSM8K lines are a real sample (tests/data/gsm8k_sample.jsonl, MIT, tests/data/LICENSE-gsm8k).
"""

import itertools
import json
import os

import pytest

import rollout

SAMPLE = os.path.join(os.path.dirname(__file__), "data", "gsm8k_sample.jsonl")


def gsm8k_rows():
    with open(SAMPLE) as f:
        return [json.loads(line) for line in f]


def test_gsm8k_reference_answers_score_themselves():
    rows = gsm8k_rows()
    assert len(rows) >= 20
    for row in rows:
        ref = rollout.gsm8k_reference(row["answer"])
        # the worked solution ends in "#### N": its last number is N itself
        assert rollout.number_reward(row["answer"], ref) == 1.0, row["answer"][-40:]
        # and a solution that ends one off is wrong
        assert rollout.number_reward(f"so it is {rollout.last_number(ref) + 1}", ref) == 0.0


def test_gsm8k_references_with_commas_and_signs():
    refs = {rollout.gsm8k_reference(r["answer"]) for r in gsm8k_rows()}
    assert {"18", "2,125", "114,200", "1,080", "-7"} <= refs
    assert rollout.number_reward("That makes 2125 in total.", "2,125") == 1.0
    assert rollout.number_reward("That makes 2,125 in total.", "2,125") == 1.0
    assert rollout.number_reward("She lost 7, so the change is -7.", "-7") == 1.0
    assert rollout.number_reward("She lost 7.", "-7") == 0.0


@pytest.mark.parametrize("completion, reference, expected", [
    ("The answer is 1,234.", "1234", 1.0),
    ("The answer is 1,234.", "1,234", 1.0),
    ("$18", "18", 1.0),
    ("She makes $18.00 every day.", "18", 1.0),
    ("18 apples", "18", 1.0),
    ("It is 17, no wait: 18", "18", 1.0),
    ("It is 18, no wait: 17", "18", 0.0),
    ("I cannot tell.", "18", 0.0),
    ("", "18", 0.0),
    ("3-4 = -1", "-1", 1.0),
    ("1.5 hours", "1.5", 1.0),
])
def test_number_reward_tricky_completions(completion, reference, expected):
    assert rollout.number_reward(completion, reference) == expected


def test_last_number():
    assert rollout.last_number("The answer is 1,234.") == 1234.0
    assert rollout.last_number("no number at all") is None
    assert rollout.last_number("from 3-4") == 4.0  # a range, not minus four


def test_toy_reward():
    assert rollout.reward("toy", "7", None) == 1.0
    assert rollout.reward("toy", "x7y", None) == 1.0
    assert rollout.reward("toy", "1234568", None) == 0.0
    assert rollout.reward("toy", "77", {"answer": "7"}) == 1.0


def test_gsm8k_items_from_a_local_file_and_folder(tmp_path):
    items = rollout.load_task("gsm8k", "test", SAMPLE)
    assert len(items) == len(gsm8k_rows())
    assert items[0]["answer"] == "18" and items[0]["question"].startswith("Janet")
    (tmp_path / "test.jsonl").write_text("".join(open(SAMPLE).readlines()[:3]))
    assert len(rollout.load_task("gsm8k", "test", str(tmp_path))) == 3


def test_arith_test_split_is_held_out():
    train, test = rollout.load_task("arith", "train"), rollout.load_task("arith", "test")
    assert len(train) + len(test) == 21 * 21
    assert 70 <= len(test) <= 110  # one pair in five
    train_q, test_q = {i["question"] for i in train}, {i["question"] for i in test}
    assert not train_q & test_q
    for item in test:
        a, b = map(int, item["question"][len("What is "):-1].split(" + "))
        assert rollout.arith_is_test(a, b) and int(item["answer"]) == a + b
    # unseen pairs, not unseen answers: the held-out sums end in any digit, as the training sums do
    assert {int(i["answer"]) % 10 for i in test} == {int(i["answer"]) % 10 for i in train} == set(range(10))
    assert sum(int(i["answer"]) % 5 == 0 for i in test) < len(test) / 2
    # the order is fixed, whatever the seed: --limit always picks the same problems
    assert [i["question"] for i in rollout.load_task("arith", "test")] == [i["question"] for i in test]


def test_arith_reward():
    item = {"question": "What is 12 + 9?", "answer": "21"}
    assert rollout.reward("arith", "12 + 9 = 21", item) == 1.0
    assert rollout.reward("arith", "The sum of 12 and 9 is 21.", item) == 1.0
    assert rollout.reward("arith", "12 + 9", item) == 0.0


def test_sharding_differs_per_replica():
    n = 100
    take = lambda rid, k: list(itertools.islice(rollout.shard_order(n, 0, rid, 2), k))  # noqa: E731
    a, b = take(0, 200), take(1, 200)
    assert set(a[:50]) == set(range(0, n, 2)) and set(b[:50]) == set(range(1, n, 2))  # disjoint slices
    assert a[:50] != a[50:100]  # reshuffled every epoch
    # one replica of one still walks a different order for another seed
    assert take(0, n) != list(itertools.islice(rollout.shard_order(n, 1, 0, 1), n))
    # the toy task has one prompt: every replica uses it
    assert set(itertools.islice(rollout.shard_order(1, 0, 3, 4), 5)) == {0}


def test_vllm_rank_rounding():
    assert [rollout.vllm_rank(r) for r in (1, 2, 8, 9, 33, 300)] == [1, 8, 8, 16, 64, 320]
