"""The trainer's check of the rewards a replica claims: each completion's reward recomputed with
the run's reward functions (support/rewards.py: --task, or --dataset with --reward-funcs, the
replicas' flags) from the group's row and the completion's ids, as the replica computes it. A
credential that makes up rewards (all equal, or 1 for a wrong answer) is caught at the first group
it sends.

    checked          the prompt_ids are the templated prompt of the group's row; every reward is
                     the weighted sum of the functions on the decoded ids (within 1e-6, relative)
    unverifiable     a function that raises on the group (math-verify past its bound: a
                     MathTimeout) or misbehaves: the group is dropped as `reward_unverifiable`
                     and its sender charged like a liar (a replica running the same functions
                     would not have sent it); that sender's later groups are dropped unchecked,
                     so one credential costs the check one group's bound in the whole run
    off              no task given, or a function marked `deterministic = False` (an LLM judge):
                     a line on stdout says so, the replicas' rewards are trusted

A group names its row (GROUP_OPTIONAL's "item": the index in the train split, which
rollout.Replica.batch sets); one without it cannot be checked and is dropped as well. What a
check costs per step is the step record's `reward_check_s`; measured: docs/hostile-peers.md and
docs/math.md. This module imports no role file.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_rewards.py -q -k check
"""

import time

from support.rewards import RewardFuncError, make_task, templated
from support.tasks import completion_text


class TaskRewards:
    """The reward check of one run (UsableGroups calls its problem(group): None for an honest
    group, test_honest_groups_pass_the_trainers_checks_unchanged_at_the_defaults): the task
    (rows and functions), the tokenizer, each row's prompt ids (tokenized once), the workers
    caught with an unverifiable group, and the seconds spent checking (lap). `task`:
    support/rewards.py's task_spec of the trainer's flags, or None."""

    def __init__(self, task, data, model):
        self.task, self.prompts, self.caught, self.seconds = None, {}, set(), 0.0
        if not task:
            print("reward check: off (no --task or --dataset given): the replicas' rewards are "
                  "trusted", flush=True)
            return
        task = make_task(task, data)
        if not task.deterministic:
            print(f"reward check: off (a reward function of {task.name} is marked "
                  "deterministic = False): the replicas' rewards are trusted", flush=True)
            return
        from transformers import AutoTokenizer

        self.tokenizer, self.task = AutoTokenizer.from_pretrained(model), task
        names = ", ".join(name for name, _ in task.funcs)
        print(f"reward check: on ({task.name}, {len(task.rows('train'))} train rows, {names}): "
              "every completion's reward is recomputed from its ids", flush=True)

    def problem(self, g):
        """(kind, why) when group g's prompt is not its row's or a claimed reward is not the
        functions'; None when it checks out, or the check is off. g passed group_problem."""
        if self.task is None:
            return None
        t0 = time.perf_counter()
        try:
            return self._problem(g)
        finally:
            self.seconds += time.perf_counter() - t0

    def _problem(self, g):
        rows = self.task.rows("train")
        i, n = g.get("item"), len(rows)
        if type(i) is not int or not 0 <= i < n:
            return "no_item", (f"item {str(i)[:20]} is not one of the task's {n} train rows: a "
                               "replica of this version names its prompt's")
        if str(g.get("worker")) in self.caught:
            return "reward_unverifiable", "its sender sent an unverifiable group before"
        if i not in self.prompts:
            self.prompts[i] = templated(self.tokenizer, rows[i]["prompt"])[1]
        if g["prompt_ids"] != self.prompts[i]:
            return "prompt_mismatch", f"prompt_ids are not the prompt of row {i}"
        ids = [c["ids"] for c in g["completions"]]
        texts = [completion_text(self.tokenizer, x) for x in ids]
        try:
            want, _ = self.task.score(rows[i], texts, ids, f"train row {i}")
        except RewardFuncError as e:
            self.caught.add(str(g.get("worker")))
            return "reward_unverifiable", str(e)
        for j, (w, c) in enumerate(zip(want, g["completions"])):
            if abs(w - c["reward"]) > 1e-6 * max(1.0, abs(w)):
                return "reward_mismatch", (f"completion {j} claims reward {c['reward']:g}; its "
                                           f"ids score {w:g} on row {i}")
        return None

    def lap(self):
        """Seconds spent checking since the last lap (a step's `reward_check_s`)."""
        spent, self.seconds = self.seconds, 0.0
        return round(spent, 4)
