"""The trainer's check of the rewards a replica claims: each completion's reward recomputed from
the task's item and the completion's ids, as the replica computes it. A credential that makes up
rewards (all equal, or 1 for a wrong answer) is caught at the first group it sends.

    task         prompt check                     reward recomputed from
    arith, gsm8k prompt_ids = the item's          the decoded ids' last number
    math         chat-templated question          the decoded ids' last \\boxed{} (math-verify)
    toy, none    off (a line says so at the start: the toy reward checks nothing worth a lie)

A group names its item (GROUP_OPTIONAL's "item": the index in the task's train split, which
rollout.Replica.batch sets); one without it cannot be checked and is dropped as well. What a
check costs per step is the step record's `reward_check_s`; measured: docs/hostile-peers.md.
This module imports no role file.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_rewards.py -q -k check
"""

import time

from support.tasks import chat_prompt, completion_text, load_task, reward

VERIFIABLE = ("arith", "gsm8k", "math")  # the tasks whose reward the trainer can recompute


class TaskRewards:
    """The reward check of one run: the task's train items, the tokenizer, each item's prompt ids
    (tokenized once), and the seconds spent checking (lap)."""

    def __init__(self, task, data, model):
        self.task, self.items, self.prompts, self.seconds = task, None, {}, 0.0
        if task not in VERIFIABLE:
            print(f"reward check: off (--task {task or 'not given'}: the trainer recomputes the "
                  f"rewards of {', '.join(VERIFIABLE)} only); the replicas' rewards are trusted")
            return
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.items = load_task(task, "train", data)
        print(f"reward check: on (--task {task}, {len(self.items)} train items): every "
              "completion's reward is recomputed from its ids")

    def problem(self, g):
        """(kind, why) when group g's prompt is not its item's or a claimed reward is not the
        task's; None when it checks out, or the check is off. g passed group_problem."""
        if self.items is None:
            return None
        t0 = time.perf_counter()
        try:
            return self._problem(g)
        finally:
            self.seconds += time.perf_counter() - t0

    def _problem(self, g):
        i, n = g.get("item"), len(self.items)
        if type(i) is not int or not 0 <= i < n:
            return "no_item", (f"item {str(i)[:20]} is not one of the task's {n} train items: a "
                               "replica of this version names its prompt's")
        if i not in self.prompts:
            self.prompts[i] = chat_prompt(self.tokenizer, self.items[i]["question"])[1]
        if g["prompt_ids"] != self.prompts[i]:
            return "prompt_mismatch", f"prompt_ids are not the prompt of item {i}"
        for j, c in enumerate(g["completions"]):
            want = reward(self.task, completion_text(self.tokenizer, c["ids"]), self.items[i])
            if abs(want - c["reward"]) > 1e-6:
                return "reward_mismatch", (f"completion {j} claims reward {c['reward']:g}; its "
                                           f"ids score {want:g} on item {i}")
        return None

    def lap(self):
        """Seconds spent checking since the last lap (a step's `reward_check_s`)."""
        spent, self.seconds = self.seconds, 0.0
        return round(spent, 4)
