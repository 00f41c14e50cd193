"""The run's contract and the group record: what all three roles share, defined once.

    CONTRACT      the settings every role must share (TRL's names), served by the proxy's
                  GET /config; rollout.py and trainer.py read them from there
    GROUP         the record a replica POSTs: one prompt, its G completions (COMPLETION), their
                  log-probs and rewards; make_group and make_completion build one
    validate_*    the proxy's check of a POSTed record, field by field, against the contract

Fields and status codes: docs/protocol.md. This module imports no role file.

    python -m pytest tests/test_proxy.py tests/test_contract.py -q
"""

from support.defaults import DEFAULTS, TABLE
from support.http_hardening import ApiError, check

MAX_NAME = 256          # characters in a group_id or a worker name
MAX_COMPLETIONS = 4096  # completions in one group
MAX_INT = 2**31         # token ids and versions lie in [0, 2^31)
MAX_ABS = 1e30          # |reward| below this; also rejects NaN and +-Infinity
REWARD_LIMIT = DEFAULTS["reward_range"][1]  # the default reward_range is [-this, this]
MIN_LOGPROB = -1000.0   # a sampled token's log-prob lies in [this, 0] (fp32 cannot go below ~-104)


class ConfigError(ValueError):
    """A serve() setting that cannot work; the message says what to change."""


# ---- the contract

# The settings every role must share (TRL's names), and their defaults: the "contract" rows of
# support/defaults.py. proxy.py takes them as flags; rollout.py and trainer.py read them from
# GET /config, so a run cannot disagree with itself.
CONTRACT = {r.name: r.type(r.default) for r in TABLE if r.role == "contract"}
CONTRACT["max_new_tokens"] = CONTRACT["max_completion_length"]  # its old name, kept equal to it
OLD_NAMES = {"max_new_tokens": "max_completion_length"}  # still a flag, served, and accepted
# The settings a role may also be given as flags, only to double-check GET /config (one that
# disagrees is an error: ProxyClient.contract). Each role takes those it has.
CONTRACT_FLAGS = ("num_generations", "groups_per_step", "max_staleness", "temperature",
                  "max_completion_length")


# ---- the group record: the one definition of a group (make_group builds it, the proxy checks
# it field by field in validate_group, trainer.flatten_groups reads it)

# The JSON schema, one row per field: (test, what the value must be). Any other field is refused, so
# that a NaN cannot ride along. Each log-prob gets its own check in validate_group().
INDEX = (lambda v: type(v) is int and 0 <= v < MAX_INT,  # a token id or a version
         f"an integer in [0, {MAX_INT})")
FINITE = (lambda v: type(v) in (int, float) and -MAX_ABS < v < MAX_ABS,  # not a bool; NaN fails
          "a finite number")
NAME = (lambda v: type(v) is str and 0 < len(v) <= MAX_NAME,
        f"a string of 1 to {MAX_NAME} characters")
TEXT = (lambda v: type(v) is str, "a string")
TOKEN_IDS = (lambda v: type(v) is list and all(map(INDEX[0], v)),
             f"a list of token ids in [0, {MAX_INT})")
GROUP = {"group_id": NAME,  # unique: a group_id seen before is a retry
         "policy_version": INDEX,  # the adapter version that sampled it
         "worker": NAME,  # the replica's name (replica-{i})
         "prompt": TEXT, "prompt_ids": TOKEN_IDS,  # the chat-templated prompt, and its ids
         "temperature": (lambda v: FINITE[0](v) and v > 0, "a number > 0"),
         # the run's; a group may carry it as max_new_tokens (the old name) too, or instead
         "max_completion_length": (lambda v: INDEX[0](v) and v > 0, "an integer > 0"),
         "completions": (lambda v: type(v) is list and 0 < len(v) <= MAX_COMPLETIONS,
                         f"a list of 1 to {MAX_COMPLETIONS} completions")}  # G of COMPLETION
# optional fields (a replica of an older version sends none): "item", the index of the prompt's
# row in the dataset's train split (support/rewards.py's Task), so that the trainer can check
# the prompt and recompute every reward with the same functions (support/reward_check.py)
GROUP_OPTIONAL = {"item": INDEX}
# a POST /rollouts body's optional fields beside "groups": the groups of the replica's lease that
# a reward function failed on (dropped there), and the replica's name (validate_rollouts)
ROLLOUTS_OPTIONAL = {"reward_errors": (lambda v: type(v) is int and 0 <= v <= MAX_COMPLETIONS,
                                       f"an integer in [0, {MAX_COMPLETIONS}]"),
                     "worker": NAME}
COMPLETION = {"ids": TOKEN_IDS,  # the sampled ids, up to and including the first EOS
              "logprobs": (lambda v: type(v) is list, "a list of numbers"),  # one per id, sampler's
              "reward": FINITE, "text": TEXT,
              "finish_reason": (lambda v: type(v) is str and 0 < len(v) <= 64,  # stop or length
                                "a string of 1 to 64 characters")}


def make_group(*, group_id, policy_version, worker, prompt, prompt_ids, temperature,
               max_completion_length, completions, item=None):
    """A group record with exactly GROUP's fields, and GROUP_OPTIONAL's "item" when given: what a
    replica POSTs (rollout.Replica.batch)."""
    g = {"group_id": group_id, "policy_version": policy_version, "worker": worker,
         "prompt": prompt, "prompt_ids": list(prompt_ids), "temperature": temperature,
         "max_completion_length": max_completion_length, "completions": completions}
    return g if item is None else {**g, "item": item}


def make_completion(*, ids, logprobs, reward, text, finish_reason):
    """One completion of a group, with exactly COMPLETION's fields."""
    return {"ids": list(ids), "logprobs": list(logprobs), "reward": reward, "text": text,
            "finish_reason": finish_reason}



# ---- the proxy's check of a POSTed record (proxy.py's POST /rollouts)

def check_fields(d, where, schema):
    """Raise ApiError naming the first field of the JSON object `d` that `schema` does not allow."""
    check(type(d) is dict, where, "must be a JSON object")
    extra = set(d) - set(schema)
    check(not extra, where, f"unknown fields {sorted(extra)[:5]} (expected {sorted(schema)})")
    for key, (ok, what) in schema.items():
        check(key in d, f"{where}.{key}", "missing")
        check(ok(d[key]), f"{where}.{key}", f"must be {what}, got {type(d[key]).__name__}")


def validate_group(g, contract, where="group"):
    """Nothing for a valid group (validate_rollouts' test); else ApiError naming its first bad
    field, or a setting that differs from the run's. The length may come under its old name,
    max_new_tokens, beside or instead of max_completion_length: each checked under the name it
    came as."""
    check(type(g) is dict, where, "must be a JSON object")
    schema = {**GROUP, **{k: v for k, v in GROUP_OPTIONAL.items() if k in g}}
    if "max_new_tokens" in g:
        schema["max_new_tokens"] = GROUP["max_completion_length"]
        if "max_completion_length" not in g:
            del schema["max_completion_length"]
    check_fields(g, where, schema)
    length = "max_completion_length" if "max_completion_length" in g else "max_new_tokens"
    check(g.get("max_new_tokens") in (None, g[length]), f"{where}.max_new_tokens",
          f"{g.get('max_new_tokens')}, but max_completion_length is {g[length]}: send one value")
    # a sampler at another temperature would bias every ratio
    for key, ours in (("temperature", "temperature"), (length, "max_completion_length")):
        flag = "--" + ours.replace("_", "-")
        check(g[key] == contract[ours], f"{where}.{key}", f"{g[key]}, but this run samples with "
              f"{key} {contract[ours]} (proxy.py {flag}): start rollout.py without {flag}, it "
              "takes the proxy's")
    n, G = len(g["completions"]), contract["num_generations"]
    check(n == G, f"{where}.completions", f"{n} completions, but this run has num_generations {G} "
           "(proxy.py --num-generations): start rollout.py without --num-generations")
    n, most = len(g["prompt_ids"]), contract["max_prompt_length"]
    check(0 < n <= most, f"{where}.prompt_ids", f"{n} ids, but a prompt has 1 to "
          f"max_prompt_length {most} (proxy.py --max-prompt-length)")
    lo, hi = contract["reward_range"]
    for j, c in enumerate(g["completions"]):
        check_fields(c, w := f"{where}.completions[{j}]", COMPLETION)
        lps, ids = c["logprobs"], c["ids"]
        check(ids, f"{w}.ids", "empty: a completion has at least one token (the EOS)")
        check(lo <= c["reward"] <= hi, f"{w}.reward", f"{c['reward']:g} is outside this run's "
              f"reward_range [{lo:g}, {hi:g}] (proxy.py --reward-range LO HI)")
        bad = next((i for i, x in enumerate(lps)
                    if type(x) not in (int, float) or not MIN_LOGPROB <= x <= 0), None)
        if bad is not None:
            raise ApiError(f"{w}.logprobs[{bad}]: must be a log-prob in [{MIN_LOGPROB:g}, 0], got "
                           f"{str(lps[bad])[:40]}")
        check(len(lps) == len(ids), f"{w}.logprobs",
              f"{len(lps)} log-probs for {len(ids)} ids (one per token)")
        check(len(ids) <= g[length], f"{w}.ids", f"{len(ids)} tokens exceed {length} {g[length]}")
    check_model_limits(g, contract, where)


def check_model_limits(g, contract, where):
    """What the trainer's model takes, once the trainer announced it (POST /version's vocab_size
    and context_length, then in GET /config): every token id below vocab_size, and prompt +
    completion within context_length. The trainer would drop such a group after the proxy had
    counted it as taken."""
    vocab, context = contract.get("vocab_size"), contract.get("context_length")
    hint = "(announced by the trainer): is this replica running the trainer's --model?"
    for field, ids in [("prompt_ids", g["prompt_ids"])] + [
            (f"completions[{j}].ids", c["ids"]) for j, c in enumerate(g["completions"])]:
        check(vocab is None or max(ids) < vocab, f"{where}.{field}",
              f"token id {max(ids)} is outside the trainer's vocabulary of {vocab} ids {hint}")
    longest = len(g["prompt_ids"]) + max(len(c["ids"]) for c in g["completions"])
    check(context is None or longest <= context, f"{where}.completions",
          f"{longest} tokens of prompt + completion exceed the trainer's context_length {context} "
          f"{hint}")


def validate_rollouts(payload, max_groups, contract):
    """The groups of a valid POST /rollouts body, as posted; else ApiError naming the field
    (tests/test_proxy.py::test_a_valid_run_passes_the_http_layer_as_sent: as posted).
    Every one checked before anything is changed (a group with the length's old name,
    max_new_tokens, is handed out with it; tests/test_proxy.py's 400s). Optional:
    `reward_errors`, the groups its replica dropped because a reward function failed on them,
    with its `worker` (then `groups` may be empty): counted against its lease and in the
    trainer's step (support/worker_bounds.py's GuardedBuffer.add)."""
    check(type(payload) is dict, "body", "must be a JSON object")
    body = {"groups": (lambda v: type(v) is list, "a list"),
            **{k: v for k, v in ROLLOUTS_OPTIONAL.items() if k in payload}}
    check_fields(payload, "body", body)
    groups, failed = payload["groups"], payload.get("reward_errors", 0)
    check(groups != [] or failed > 0, "groups", "must be a non-empty list (or reward_errors > 0)")
    check(not failed or "worker" in payload, "worker", "missing: the worker whose reward "
          "functions failed (reward_errors counts against its lease)")
    check(len(groups) <= max_groups, "groups",
          f"{len(groups)} in one POST exceed --max-groups {max_groups}")
    for i, g in enumerate(groups):
        validate_group(g, contract, f"groups[{i}]")
    return groups


def check_contract(c):
    """A contract that can work: nothing but reward_range made a [lo, hi] list of floats.
    Else ConfigError naming the first setting of the contract c that cannot work."""
    lo, hi = c["reward_range"] = [float(x) for x in c["reward_range"]]
    works = {"num_generations": c["num_generations"] >= 2,
             "groups_per_step": c["groups_per_step"] >= 1,
             "max_staleness": c["max_staleness"] >= 0, "temperature": c["temperature"] > 0,
             "max_completion_length": c["max_completion_length"] >= 1,
             "zero_variance": c["zero_variance"] in ("keep", "drop"),
             "max_prompt_length": c["max_prompt_length"] >= 1,
             "reward_range": -MAX_ABS < lo < hi < MAX_ABS}
    for key in (k for k, ok in works.items() if not ok):
        raise ConfigError(f"--{key.replace('_', '-')} {c[key]!r} cannot work: need "
                          "num-generations >= 2, groups-per-step >= 1, max-staleness >= 0, "
                          "temperature > 0, max-new-tokens >= 1, zero-variance keep or drop, "
                          "max-prompt-length >= 1, reward-range LO < HI")
