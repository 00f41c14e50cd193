"""What the trainer checks in the groups a replica sent before they reach the step: a hostile
replica's group must not crash, steer or poison the learner (group_problem), nor lie about
its rewards (support/reward_check.py); a dropped group is reported to the proxy (UsableGroups,
the one call where the trainer's groups arrive); and how long the trainer waits for them (Waiting).

This module imports no role file.
"""

import math
import sys
import time

from support.proxy_client import ProxyError
from support.trainer_state import TrainerError


class Waiting:
    """gather_groups' patience: a line every minute saying what the proxy sees, and a
    TrainerError once wait_timeout seconds (0: never) passed without the groups."""

    def __init__(self, client, wait_timeout, bucket_url):
        self.client, self.wait_timeout, self.bucket_url = client, wait_timeout, bucket_url
        self.start = self.last_log = time.time()

    def check(self, have, n):
        waited, timeout = time.time() - self.start, self.wait_timeout
        if (timeout and waited > timeout) or time.time() - self.last_log > 60:
            s = self.client.stats()  # the proxy sees the whole run: say what it sees
            why = (f"the proxy has {s['buffered']} groups buffered, leases {s['leased']}, dropped "
                   f"{s['dropped_stale']} as stale and {s['dropped_zero_variance']} with equal "
                   "rewards; replicas that load no new adapter ('adapter vN loaded' in their logs) "
                   f"are not reading --bucket {self.bucket_url}")
            if timeout and waited > timeout:
                raise TrainerError(f"no groups for {waited:.0f}s (have {have}/{n}): {why}; "
                                   "raise --wait-timeout for slow starts")
            print(f"waiting for groups: {have}/{n} after {waited:.0f}s; {why}")
            self.last_log = time.time()


class UsableGroups:
    """Of each proxy answer, the groups the trainer can use: valid ones unchanged, in order.
    (tests/test_rewards.py::test_honest_groups_pass_the_trainers_checks_unchanged_at_the_defaults)
    A group it cannot use (group_problem; limits: num_generations, context, reward_range) or whose
    rewards are not its task's (`rewards`: a reward_check.TaskRewards, or None) is named on
    stderr, counted (lap) and reported to the proxy (POST /reject), which gives it back to the
    step's quota and bans its worker: a drop never leaves the trainer waiting on a group nobody
    makes. The rest of this file: how (not needed to follow a step, by the test above)."""

    def __init__(self, client, vocab_size, rewards=None, **limits):
        self.client, self.vocab_size, self.limits = client, vocab_size, limits
        self.rewards = rewards
        self.dropped = {}  # kind -> groups dropped since the last lap
        self.reward_errors = 0  # the proxy's count of the replicas' drops at the last lap

    def __call__(self, groups):
        kept, reports = [], []
        for g in groups:
            problem = (group_problem(g, self.vocab_size, **self.limits)
                       or (self.rewards and self.rewards.problem(g)))
            if not problem:
                kept.append(g)
                continue
            named(g, problem, self.dropped)
            gid, worker = (str(g.get(k) if isinstance(g, dict) else "?")[:256] or "?"
                           for k in ("group_id", "worker"))
            reports.append({"group_id": gid, "worker": worker, "kind": problem[0],
                            "why": problem[1]})
        try:
            if reports:
                self.client.reject(reports)
        except ProxyError as e:  # an older proxy.py: the step may wait for a lease nobody holds
            print(f"could not report {len(reports)} dropped groups to the proxy: {e}",
                  file=sys.stderr)
        return kept

    def lap(self):
        """kind -> groups dropped since the last lap (a step's `groups_dropped`); with
        "reward_func_error", those the replicas dropped because a reward function failed on them
        (the proxy counts them: ProxyClient.reward_errors; a restarted proxy counts from 0)."""
        total = getattr(self.client, "reward_errors", 0)  # the run's, in the last /batch answer
        new = total - self.reward_errors if total >= self.reward_errors else total
        if new > 0:
            self.dropped["reward_func_error"] = new
        self.reward_errors = total
        dropped, self.dropped = self.dropped, {}
        return dropped


def named(g, problem, dropped):
    """A dropped group: named on stderr, counted in `dropped` (kind -> count)."""
    dropped[problem[0]] = dropped.get(problem[0], 0) + 1
    gid, worker = (printable(g.get(k) if isinstance(g, dict) else "?")
                   for k in ("group_id", "worker"))
    print(f"dropped group {gid} from {worker}: {problem[1]}", file=sys.stderr)


def group_problem(g, vocab_size, num_generations=None, context=None, reward_range=None):
    """(kind, why) when the trainer cannot use group g (the proxy's JSON), else None. The proxy
    checks groups too; this holds on its own: one bad group must not crash or poison a step."""
    def ids_ok(ids):
        return type(ids) is list and all(type(t) is int and 0 <= t < vocab_size for t in ids)

    def number(x, lo=-math.inf, hi=math.inf):  # NaN fails
        return type(x) in (int, float) and lo <= x <= hi and math.isfinite(x)

    lo, hi = reward_range or (-math.inf, math.inf)
    try:
        comps, prompt = g["completions"], g["prompt_ids"]
        if num_generations is not None and len(comps) != num_generations:
            return "num_completions", f"{len(comps)} completions, not {num_generations}"
        if not prompt:
            return "empty_prompt", "no prompt tokens (prompt_ids: [])"
        for j, c in enumerate(comps):
            ids, lps = c["ids"], c["logprobs"]
            if not ids:
                return "empty_completion", f"completion {j} has no tokens (ids: [])"
            if not (ids_ok(prompt) and ids_ok(ids)):
                return "token_id", f"a token id >= the vocabulary size {vocab_size} (or < 0)"
            if len(lps) != len(ids) or not all(map(number, lps)):
                return "logprobs", (f"completion {j}: {len(lps)} log-probs for {len(ids)} ids, "
                                    "or NaN")
            if not number(c["reward"], lo, hi):
                r = str(c["reward"])[:30]
                return "reward", f"completion {j}: reward {r} not in [{lo:g}, {hi:g}]"
        longest = len(prompt) + max(len(c["ids"]) for c in comps)
        if context is not None and longest > context:
            return "too_long", f"{longest} tokens of prompt + completion > the context {context}"
        int(g["policy_version"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return "malformed", "not a group in the proxy's JSON form"
    return None


def printable(v, n=64):
    """A peer's string for a log line: at most n characters, no control character (no fake line)."""
    return "".join(ch if ch.isprintable() else "?" for ch in str(v)[:n])
