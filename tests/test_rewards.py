"""Rewards, task splits and sharding of rollout.py: pure functions (and math-verify's process);
one --eval run of the tiny model on MATH problems.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_rewards.py -q

GSM8K lines are a real sample (tests/data/gsm8k_sample.jsonl, MIT, tests/data/LICENSE-gsm8k);
so are the MATH lines (tests/data/math_sample.jsonl: 52 MATH-500 problems, MIT,
tests/data/LICENSE-math).
"""

import itertools
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from support import engines, rewards, tasks

DATA = os.path.join(os.path.dirname(__file__), "data")
SAMPLE = os.path.join(DATA, "gsm8k_sample.jsonl")
MATH_SAMPLE = os.path.join(DATA, "math_sample.jsonl")


def number_reward(completion, reference):
    """The built-in reward on one completion (TRL's convention: lists in, a list out)."""
    return tasks.number_reward([completion], [reference])[0]


def math_reward(completion, reference):
    return tasks.boxed_math_reward([completion], [reference])[0]


def gsm8k_rows():
    with open(SAMPLE) as f:
        return [json.loads(line) for line in f]


def test_gsm8k_reference_answers_score_themselves():
    rows = gsm8k_rows()
    assert len(rows) >= 20
    for row in rows:
        ref = tasks.gsm8k_reference(row["answer"])
        # the worked solution ends in "#### N": its last number is N itself
        assert number_reward(row["answer"], ref) == 1.0, row["answer"][-40:]
        # and a solution that ends one off is wrong
        assert number_reward(f"so it is {tasks.last_number(ref) + 1}", ref) == 0.0


def test_gsm8k_references_with_commas_and_signs():
    refs = {tasks.gsm8k_reference(r["answer"]) for r in gsm8k_rows()}
    assert {"18", "2,125", "114,200", "1,080", "-7"} <= refs
    assert number_reward("That makes 2125 in total.", "2,125") == 1.0
    assert number_reward("That makes 2,125 in total.", "2,125") == 1.0
    assert number_reward("She lost 7, so the change is -7.", "-7") == 1.0
    assert number_reward("She lost 7.", "-7") == 0.0


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
    assert number_reward(completion, reference) == expected


def test_last_number():
    assert tasks.last_number("The answer is 1,234.") == 1234.0
    assert tasks.last_number("no number at all") is None
    assert tasks.last_number("from 3-4") == 4.0  # a range, not minus four


def test_toy_reward():
    assert tasks.seven_reward(["7", "x7y", "1234568", "77"]) == [1.0, 1.0, 0.0, 1.0]
    # a conversational prompt's completions are messages: the same scores
    assert tasks.seven_reward([[{"role": "assistant", "content": "x7"}]]) == [1.0]


def question(row):
    return row["prompt"][0]["content"]


def test_gsm8k_items_from_a_local_file_and_folder(tmp_path):
    (tmp_path / "test.jsonl").write_text("".join(open(SAMPLE).readlines()[:3]))
    items = tasks.load_task("gsm8k", "test", str(tmp_path))
    assert len(items) == 3 and items[0]["answer"] == "18" and question(items[0]).startswith("Janet")
    assert items[0]["prompt"][0]["role"] == "user"


def test_one_data_file_is_split_not_read_twice():
    """Issue 51: --data as one file was read for both splits, so the held-out score was on
    training rows. Now its test rows are held out by the stated rule (test_split_size of it, seed
    0), never trained on, the same in every process."""
    train, test = tasks.load_task("gsm8k", "train", SAMPLE), tasks.load_task("gsm8k", "test", SAMPLE)
    assert len(train) + len(test) == len(gsm8k_rows()) and len(test) >= 1
    assert not {question(r) for r in train} & {question(r) for r in test}
    tasks.split_file.cache_clear()
    assert tasks.load_task("gsm8k", "test", SAMPLE) == test  # deterministic


def test_arith_test_split_is_held_out():
    train, test = tasks.load_task("arith", "train"), tasks.load_task("arith", "test")
    assert len(train) + len(test) == (tasks.ARITH_MAX + 1) ** 2 == 51 * 51
    assert len(test) == 411  # one pair in six: a standard error of at most 2.5 points
    train_q, test_q = {question(i) for i in train}, {question(i) for i in test}
    assert not train_q & test_q
    for item in test:
        a, b = map(int, question(item)[len("What is "):-1].split(" + "))
        assert tasks.arith_is_test(a, b) and int(item["answer"]) == a + b
    # unseen pairs, not unseen answers: the held-out sums end in any digit, as the training sums do
    assert {int(i["answer"]) % 10 for i in test} == {int(i["answer"]) % 10 for i in train} == set(range(10))
    assert sum(int(i["answer"]) % 5 == 0 for i in test) < len(test) / 2
    # the order is fixed, whatever the seed: --limit always picks the same problems
    assert [question(i) for i in tasks.load_task("arith", "test")] == [question(i) for i in test]


def test_arith_reward():
    assert tasks.BUILTIN["arith"] is tasks.number_reward
    assert tasks.number_reward(["12 + 9 = 21", "The sum of 12 and 9 is 21.", "12 + 9"],
                               ["21"] * 3) == [1.0, 1.0, 0.0]


def test_sharding_differs_per_replica():
    n = 100
    take = lambda rid, k: list(itertools.islice(tasks.shard_order(n, 0, rid, 2), k))  # noqa: E731
    a, b = take(0, 200), take(1, 200)
    assert set(a[:50]) == set(range(0, n, 2)) and set(b[:50]) == set(range(1, n, 2))  # disjoint slices
    assert a[:50] != a[50:100]  # reshuffled every epoch
    # one replica of one still walks a different order for another seed
    assert take(0, n) != list(itertools.islice(tasks.shard_order(n, 1, 0, 1), n))
    # the toy task has one prompt: every replica uses it
    assert set(itertools.islice(tasks.shard_order(1, 0, 3, 4), 5)) == {0}


def test_vllm_rank_rounding():
    assert [engines.vllm_rank(r) for r in (1, 2, 8, 9, 33, 300)] == [1, 8, 8, 16, 64, 320]


# ----------------------------------------------------------------------------- MATH (math-verify)

def math_rows():
    with open(MATH_SAMPLE) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def roomy_math_limits(monkeypatch):
    """What math-verify answers, not how fast: its wall-clock limits (3 s an answer, 4 s a group)
    raised, so a loaded machine does not fail a scoring test (the limits have their own tests)."""
    monkeypatch.setattr(tasks, "MATH_TIMEOUT_S", 60.0)
    monkeypatch.setattr(tasks, "MATH_GROUP_BUDGET_S", 120.0)


@pytest.mark.usefixtures("roomy_math_limits")
def test_math_sample_solutions_score_themselves():
    rows = math_rows()
    assert len(rows) >= 50 and {"problem", "solution", "answer"} <= set(rows[0])
    for row in rows:
        # the worked solution's last \boxed{} is the short answer, as mathematics
        assert math_reward(row["solution"], row["answer"]) == 1.0, row["answer"]
        assert math_reward(f"So it is $\\boxed{{{row['answer']}}}$.", row["answer"]) == 1.0
        # and a box with another number is wrong, for every one of them
        assert math_reward(r"It is \boxed{12345}.", row["answer"]) == 0.0, row["answer"]


@pytest.mark.parametrize("completion, reference, expected", [
    (r"so \boxed{0.5}", r"\frac12", 1.0),
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\tfrac12}", "0.5", 1.0),
    (r"\boxed{\frac54}", "1.25", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
    (r"\boxed{5\text{ cm}}", "5", 1.0),  # units
    (r"\boxed{5}", r"5\text{ cm}", 1.0),
    (r"\boxed{5.4}", r"5.4 \text{ cents}", 1.0),
    (r"\boxed{\frac{270}{7}}", r"\frac{270}7\text{ degrees}", 1.0),
    (r"\boxed{90}", r"90^\circ", 1.0),
    (r"\boxed{18.9}", r"\$18.90", 1.0),
    (r"\boxed{32348}", r"\$32,\!348", 1.0),
    (r"\boxed{(0,1]}", "(0, 1]", 1.0),  # intervals: which ends are closed matters
    (r"\boxed{(0,1)}", "(0, 1]", 0.0),
    (r"\boxed{[0,1]}", "(0, 1]", 0.0),
    (r"\boxed{(-\infty,2)\cup(3,\infty)}", r"(-\infty, 2) \cup (3, \infty)", 1.0),
    (r"\boxed{[-2,7]}", r"x \in [-2,7]", 1.0),
    (r"\boxed{(3,\frac{\pi}{2})}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (r"\boxed{7,5,3}", "3, 5, 7", 1.0),
    (r"\boxed{-2+7i}", "-2 + 7i", 1.0),
    (r"\boxed{\sqrt{242}}", r"11\sqrt2", 1.0),
    (r"\boxed{p-q}", "p - q", 1.0),
    (r"\boxed{q-p}", "p - q", 0.0),
    (r"\boxed{Evelyn}", r"\text{Evelyn}", 1.0),
    (r"\boxed{\text{Briana}}", r"\text{Evelyn}", 0.0),
    (r"It is \boxed{3}. No wait: \boxed{2}", "2", 1.0),  # two boxes: the last is the answer
    (r"It is \boxed{2}. No wait: \boxed{3}", "2", 0.0),
])
@pytest.mark.usefixtures("roomy_math_limits")
def test_math_reward_equivalent_answers(completion, reference, expected):
    assert math_reward(completion, reference) == expected


@pytest.mark.parametrize("completion", [
    "", "The answer is 2.", "$2$",  # no box: the prompt asks for one
    r"\boxed{}", r"\boxed{   }", r"\boxed{2", r"\boxed{\frac{1}{", r"so \boxed{2} and \boxed{",
    r"\boxed{\frac{1}{}}", r"\boxed{)(}", r"\boxed{\sqrt}", r"\boxed{\left(}", r"\boxed{1/0}",
    "\\boxed{\x00\udcff\uffff}", "\\boxed{" + "{" * 500 + "}" * 500 + "}" + "}" * 3,
    r"\boxed{2^{2^{2^{2^{2^{2}}}}}}", "\\boxed{2}" * 5000 + "\\boxed{",
])
def test_math_reward_malformed_output_is_zero(completion):
    t0 = time.time()
    assert math_reward(completion, "2") == 0.0
    assert time.time() - t0 < tasks.MATH_GROUP_BUDGET_S + 2


def test_last_boxed():
    assert tasks.last_boxed(r"a \boxed{\frac{1}{2}} b") == r"\frac{1}{2}"
    assert tasks.last_boxed(r"\boxed{1} then \boxed{\{2, 3\}}") == r"\{2, 3\}"
    assert tasks.last_boxed(r"\boxed{1} then \boxed{2") is None  # the last one never closed
    assert tasks.last_boxed("no box") is None and tasks.last_boxed(r"\boxed{}") == ""


def test_math_reward_in_threads():
    """math-verify's own timeouts need the main thread; the scorer works from any thread."""
    cases = [(r"\boxed{0.5}", r"\frac12", 1.0), (r"\boxed{(0,1)}", "(0, 1]", 0.0),
             (r"\boxed{\dfrac{14}{3}}", r"\frac{14}{3}", 1.0), (r"\boxed{3}", "4", 0.0)] * 5
    got = {}

    def score(i, completion, reference):
        got[i] = math_reward(completion, reference)

    threads = [threading.Thread(target=score, args=(i, *c[:2])) for i, c in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {i: c[2] for i, c in enumerate(cases)}


def test_math_scorer_kills_a_stuck_check():
    """An answer math-verify takes seconds on (a power tower) is None (unverifiable) after the
    caller's limit, not after math-verify's own timeouts; the next answer is scored by a fresh
    process."""
    scorer = tasks.MathScorer()
    assert scorer(r"\frac12", "0.5") == 1.0  # started
    first = scorer.proc.pid
    t0 = time.time()
    assert scorer(r"9^{9^{9^{9}}}", "2", timeout_s=0.5) is None
    assert time.time() - t0 < 2.0
    assert scorer("2", "2") == 1.0 and scorer.proc.pid != first
    scorer.proc.kill()  # died between calls: replaced before the next answer
    scorer.proc.wait()
    assert scorer("2", "2") == 1.0
    scorer.close()


@pytest.mark.parametrize("answer, why", [
    ("9^{9^{9}}", "a power in an exponent"), ("9^9^9", "a power in an exponent"),
    ("2^{2^{2^{2^{2}}}}", "a power in an exponent"), ("9^{999999999}", "an exponent of 4+"),
    ("10^{10000}", "an exponent of 4+"), ("1000000!", "a factorial of 3+"),
    ("1" * 201, "201 characters"),
])
def test_costly_math_answers_are_refused_before_math_verify(answer, why):
    """Issue 48, case 2: answers built to cost math-verify seconds (9^{9^{9}} took its 5 s
    timeout in every check) score 0 at once: the replica's reward and the trainer's recomputed
    one agree, so an honest claim of 0 passes in milliseconds and nobody waits."""
    assert why in tasks.costly_answer(answer)
    t0 = time.time()
    assert math_reward(f"so \\boxed{{{answer}}}", "3") == 0.0
    assert time.time() - t0 < 0.5


@pytest.mark.parametrize("answer", ["x^{2}+y^{2}", "10^{-6}", "2^{10}", "e^{i\\pi}", "5!",
                                    "90^\\circ", "\\frac{1}{2}"])
def test_ordinary_math_answers_are_not_refused(answer):
    assert tasks.costly_answer(answer) is None


def test_a_math_group_past_its_bound_is_unverifiable(monkeypatch):
    """Past MATH_TIMEOUT_S on an answer, or MATH_GROUP_BUDGET_S on a group's, the reward function
    raises MathTimeout: neither right nor wrong, the group is dropped (the trainer charges its
    sender: test_the_math_check_costs_bounded_time_per_step)."""
    math_reward(r"\boxed{1}", "1")  # math-verify's process started
    monkeypatch.setattr(tasks, "MATH_TIMEOUT_S", 0.0001)  # an answer math-verify has not seen
    t0 = time.time()
    with pytest.raises(tasks.MathTimeout, match="math-verify took over"):
        tasks.boxed_math_reward([r"\boxed{\frac{1234}{4567} + \sqrt{7}}"] * 8, ["4"] * 8)
    assert time.time() - t0 < 1.0
    monkeypatch.setattr(tasks, "MATH_TIMEOUT_S", 3.0)
    monkeypatch.setattr(tasks, "MATH_GROUP_BUDGET_S", 0.0)
    with pytest.raises(tasks.MathTimeout):
        tasks.boxed_math_reward([r"\boxed{2}"], ["2"])


def test_math_items_from_a_file_a_folder_and_solutions_only(tmp_path):
    rows = math_rows()
    with open(MATH_SAMPLE) as f:
        (tmp_path / "train.jsonl").write_text("".join(f.readlines()[:3]))
    items = tasks.load_task("math", "train", str(tmp_path))
    assert [i["answer"] for i in items] == [r["answer"] for r in rows[:3]]
    assert question(items[2]).startswith(rows[2]["problem"])
    assert question(items[2]).endswith(r"put your final answer within \boxed{}.")
    # the MATH release (and the hub copy) has no short answer: the solution's last \boxed{} is it
    lighteval = tmp_path / "lighteval.jsonl"
    lighteval.write_text("".join(json.dumps({"problem": r["problem"], "level": r["level"],
                                             "type": r["subject"], "solution": r["solution"]})
                                 + "\n" for r in rows))
    items = (tasks.load_task("math", "train", str(lighteval))
             + tasks.load_task("math", "test", str(lighteval)))  # one file: both splits
    by_problem = {r["problem"]: r for r in rows}
    for i in items:
        row = by_problem[question(i).split("\nPlease reason")[0]]
        assert i["answer"] == tasks.last_boxed(row["solution"])
        assert math_reward(row["solution"], i["answer"]) == 1.0
    assert len(items) == len(rows)


@pytest.mark.parametrize("line, says", [
    ('{"problem": "1+1?", "solution": "It is 2."}', "row 2: a MATH row needs"),
    ('{"question": "1+1?", "answer": "2"}', "row 2: a MATH row needs"),
    ('["1+1?", "2"]', "row 2: a MATH row is a JSON object, not list"),
])
def test_math_rows_without_an_answer_are_named(tmp_path, line, says):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "2+2?", "answer": "4"}\n' + line + "\n")
    (tmp_path / "test.jsonl").write_text(path.read_text())
    with pytest.raises(tasks.TaskError, match=says):
        tasks.load_task("math", "test", str(tmp_path))


def test_cli_eval_math(tiny_model, tmp_path):
    """rollout.py --eval --task math runs end to end (the tiny model's accuracy is ~0: the path is
    the point), and scores its completions as math_reward does."""
    out = str(tmp_path / "eval.json")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, os.path.join(root, "rollout.py"), "--eval", "--task", "math",
           "--data", MATH_SAMPLE, "--model", tiny_model, "--engine", "hf", "--limit", "4",
           "--max-new-tokens", "8", "--no-eval-cache", "--eval-out", out]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "eval math adapter=base hf: accuracy" in r.stdout
    with open(out) as f:
        result = json.load(f)
    assert result["task"] == "math" and result["n"] == 4
    test = tasks.load_task("math", "test", MATH_SAMPLE)  # one file: its held-out rows
    assert [x["answer"] for x in result["results"]] == [r["answer"] for r in test[:4]]
    assert [x["correct"] for x in result["results"]] == \
        [math_reward(x["completion"], x["answer"]) for x in result["results"]]


# ---- the trainer's reward check (support/reward_check.py): issue 39, item 1; issue 48, case 2

def checked_group(tokenizer, task, i, texts, rewards=None, worker="w"):
    """A group as rollout.Replica.batch makes it for train row i: the row's templated prompt, one
    completion per text (its ids, EOS at the end), each scored by the task's functions."""
    row = task.rows("train")[i]
    _, prompt_ids = rewards_templated(tokenizer, row["prompt"])
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
           for t in texts]
    if rewards is None:
        rewards = task.score(row, [tasks.completion_text(tokenizer, x) for x in ids], ids, "")[0]
    comps = [{"ids": x, "logprobs": [-1.0] * len(x), "text": t, "finish_reason": "stop",
              "reward": r} for x, t, r in zip(ids, texts, rewards)]
    return {"group_id": f"g{i}", "worker": worker, "policy_version": 0, "prompt": "",
            "prompt_ids": prompt_ids, "completions": comps, "item": i}


rewards_templated = rewards.templated


def test_the_reward_check_recomputes_each_reward_and_names_a_lie(tiny_model, capsys):
    from transformers import AutoTokenizer

    from support.reward_check import TaskRewards

    check = TaskRewards({"task": "arith"}, None, tiny_model)
    assert "reward check: on (arith, 2190 train rows, number_reward)" in capsys.readouterr().out
    tok, items = AutoTokenizer.from_pretrained(tiny_model), check.task.rows("train")
    right = f"The answer is {items[3]['answer']}."
    honest = checked_group(tok, check.task, 3, [right, "I think 7.", right, "no idea"])
    assert [c["reward"] for c in honest["completions"]] == [1.0, 0.0, 1.0, 0.0]
    assert check.problem(honest) is None
    lie = checked_group(tok, check.task, 3, [right, "I think 7.", right, "no idea"], [1, 1, 1, 1])
    assert check.problem(lie) == ("reward_mismatch", "completion 1 claims reward 1; its ids score "
                                                     "0 on row 3")
    other = dict(honest, item=4)  # another row's prompt under this one's answer
    assert check.problem(other)[0] == "prompt_mismatch"
    for item in (None, -1, len(items), "3", 2.0):
        g = dict(honest, item=item) if item is not None else {
            k: v for k, v in honest.items() if k != "item"}
        assert check.problem(g)[0] == "no_item", item
    assert 0 < check.lap() < 1 and check.lap() == 0.0
    off = TaskRewards(None, None, tiny_model)
    assert off.problem(lie) is None and "reward check: off (no --task" in capsys.readouterr().out
    toy = TaskRewards({"task": "toy"}, None, tiny_model)  # any task's functions are checked now
    assert "reward check: on (toy" in capsys.readouterr().out
    assert toy.problem(checked_group(tok, toy.task, 0, ["7", "8"], [0.0, 0.0]))[0] == \
        "reward_mismatch"


@pytest.mark.parametrize("reward_check", [True, False])
def test_honest_groups_pass_the_trainers_checks_unchanged_at_the_defaults(tiny_model, capfd,
                                                                          reward_check):
    """What trainer.py builds at jobs.sh --local's settings (UsableGroups with the arith reward
    check on, the model's limits, the proxy's reward_range; and without a task, the check off)
    does nothing to valid input: honest groups handed over by a proxy come back as the same
    objects, in order, with nothing on stderr, nothing counted, nothing reported to the proxy."""
    from transformers import AutoTokenizer

    import proxy
    from support.group_checks import UsableGroups
    from support.proxy_client import ProxyClient
    from support.reward_check import TaskRewards

    check = TaskRewards({"task": "arith"}, None, tiny_model)
    tok, items = AutoTokenizer.from_pretrained(tiny_model), check.task.rows("train")
    honest = [checked_group(tok, check.task, i, [f"It is {items[i]['answer']}.", "I think 7."])
              for i in range(3)]
    server, _ = proxy.serve(port=0, num_generations=2, max_completion_length=64)
    try:
        client = ProxyClient(f"http://127.0.0.1:{server.server_address[1]}")
        client.set_version(0)
        client.post_rollouts([dict(g, temperature=1.0, max_completion_length=64) for g in honest])
        answer = client.get_batch(3, timeout=10)["groups"]
        limits = {"num_generations": 2, "context": 4096, "reward_range": (-1e6, 1e6)}
        usable = UsableGroups(client, len(tok), check if reward_check else None, **limits)
        got = usable(answer)
        stats = client.stats()
    finally:
        server.shutdown()
        server.server_close()
    assert [g["group_id"] for g in answer] == ["g0", "g1", "g2"]
    assert len(got) == 3 and all(a is b for a, b in zip(got, answer))
    assert usable.lap() == {} and stats["dropped_by_trainer"] == 0
    assert "dropped" not in capfd.readouterr().err


def test_the_math_check_costs_bounded_time_per_step(tiny_model, monkeypatch):
    """Issue 48, case 2: completions that decode to \\boxed{9^{9^{9}}} with a claimed reward of 0
    took math-verify's 5 s each in the trainer's check (20-30 s a step for 4 groups of 2). Now
    they score 0 before math-verify: 4 groups of 8 check in well under a second. A group whose
    check passes the bound anyway (MATH_GROUP_BUDGET_S made 0 here) is unverifiable: dropped, its
    sender charged, and that sender's later groups dropped unchecked, so one credential costs at
    most one group's bound (MATH_GROUP_BUDGET_S) in a whole run."""
    from transformers import AutoTokenizer

    from support.reward_check import TaskRewards

    check = TaskRewards({"task": "math"}, MATH_SAMPLE, tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    slow = [r"so \boxed{9^{9^{9}}}", r"\boxed{9^{999999999}}", r"\boxed{1000000!}",
            r"\boxed{2^{2^{2^{2^{2}}}}}"] * 2
    check.problem(checked_group(tok, check.task, 0, [r"\boxed{1}"] * 2))  # math-verify started
    check.lap()
    for i in range(4):
        assert check.problem(checked_group(tok, check.task, i, slow, [0.0] * 8, "hostile")) is None
    assert check.lap() < 1.0
    monkeypatch.setattr(tasks, "MATH_GROUP_BUDGET_S", 0.0)
    kind, why = check.problem(checked_group(tok, check.task, 5, [r"\boxed{\frac{14}{3}}"] * 8,
                                            [0.0] * 8, "hostile"))
    assert kind == "reward_unverifiable" and "boxed_math_reward on train row 5" in why, why
    monkeypatch.setattr(tasks, "MATH_GROUP_BUDGET_S", 4.0)
    later = checked_group(tok, check.task, 6, [r"\boxed{\frac{14}{3}}"] * 8, [0.0] * 8, "hostile")
    assert check.problem(later) == ("reward_unverifiable",
                                    "its sender sent an unverifiable group before")
    assert check.problem(dict(later, worker="honest")) is None
    assert check.lap() < tasks.MATH_GROUP_BUDGET_S


def test_the_built_in_prompts_are_the_chat_template_of_one_user_message(tiny_model):
    """The built-in rows are conversational (one user message), so the replica feeds the engine
    the ids it fed before the tasks became TRL-form functions: the default run is unchanged."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    for row in tasks.load_task("arith", "train")[:3] + tasks.load_task("toy", "train"):
        text = tok.apply_chat_template([{"role": "user", "content": question(row)}],
                                       add_generation_prompt=True, tokenize=False)
        assert rewards.templated(tok, row["prompt"]) == \
            (text, tok(text, add_special_tokens=False)["input_ids"])
    # a plain string is not templated (TRL's rule): its ids are the tokenizer's of the string
    assert rewards.templated(tok, "What is 1 + 1?") == ("What is 1 + 1?",
                                                        tok("What is 1 + 1?")["input_ids"])


def test_a_reward_marked_not_deterministic_turns_the_check_off_and_says_so(tiny_model, tmp_path,
                                                                           capsys):
    """A function with `deterministic = False` (an LLM judge): the trainer's check is off, the
    console says why, and a group claiming any reward passes; the same function unmarked is
    checked."""
    from transformers import AutoTokenizer

    from support.reward_check import TaskRewards

    (tmp_path / "judge.py").write_text(
        "def judge(completions, **kwargs):\n    return [0.5 for _ in completions]\n\n"
        "def marked(completions, **kwargs):\n    return [0.5 for _ in completions]\n\n"
        "marked.deterministic = False\n")
    spec = {"task": "arith", "reward_funcs": [f"{tmp_path}/judge.py:marked"]}
    off = TaskRewards(spec, None, tiny_model)
    assert off.task is None
    assert "reward check: off (a reward function of" in capsys.readouterr().out
    checked = TaskRewards(dict(spec, reward_funcs=[f"{tmp_path}/judge.py:judge"]), None,
                          tiny_model)
    assert "reward check: on (arith" in capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(tiny_model)
    lie = checked_group(tok, checked.task, 0, ["7", "8"], [1.0, 1.0])
    assert checked.problem(lie)[0] == "reward_mismatch" and off.problem(lie) is None
