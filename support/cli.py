"""The command lines of the roles, made from support/defaults.py's table: each row a role takes
is one of its flags (the row's type, default, choices and help). Written here are only the flags
without a default (where the model, the bucket and the proxy are, credentials, output files) and
the checks across flags (a bad value exits with one line saying what to set). The roles' main()
calls these.

This module imports no role file.
"""

import argparse
import os
import sys

from support.contract import CONTRACT_FLAGS, OLD_NAMES
from support.defaults import DEFAULTS, TABLE, on_off, pair
from support.rewards import add_task_flags, make_task, task_spec
from support.tasks import TaskError

ROWS = {r.name: r for r in TABLE}
DELTA = DEFAULTS["delta"]  # --delta's default (trainer.py, departure 8), as bench/ reads it


def flags(name):
    """--name, and its old spellings (--max-new-tokens for max_completion_length)."""
    return ["--" + n.replace("_", "-") for n in
            (name, *(old for old, new in OLD_NAMES.items() if new == name))]


def add_rows(p, role):
    """Each row of the table that `role` takes (support/defaults.py) as a flag: the row's type,
    default, choices and help; an on/off row as a --flag / --no-flag pair, reward_range as LO HI.
    --task: support/rewards.add_task_flags."""
    for r in TABLE:
        if role in r.role.split() and r.name != "task":
            kind = (dict(action=argparse.BooleanOptionalAction) if r.type is on_off else
                    dict(type=float, nargs=2, metavar=("LO", "HI")) if r.type is pair else
                    dict(type=r.type))
            p.add_argument(*flags(r.name), default=DEFAULTS[r.name], choices=r.choices,
                           help=r.help, **kind)


def add_contract_checks(p, names):
    """The contract's settings `names` as flags that only double-check GET /config: default None,
    the proxy's (one that disagrees is an error: support/proxy_client.ProxyClient.contract)."""
    for name in names:
        r = ROWS[name]
        p.add_argument(*flags(name), type=r.type, choices=r.choices,
                       help=f"{r.help} (default: the proxy's)")


def trainer_args(argv=None, description=None):
    """trainer.py's flags, checked (a bad value: exit with one line saying what to set)."""
    p = argparse.ArgumentParser(description=description)
    a = p.add_argument
    a("--model", required=True, help="base model: a Hub id or a local folder")
    a("--bucket", required=True, help="a directory (or mounted bucket) or s3://bucket/prefix")
    a("--proxy", required=True,
      help="the proxy's URL, e.g. http://127.0.0.1:8000 (token: env PROXY_TOKEN)")
    # The run's contract comes from the proxy (GET /config); these flags only double-check it.
    add_contract_checks(p, CONTRACT_FLAGS)
    add_rows(p, "trainer")  # the loss, the optimizer, the LoRA, memory, saving, the seed
    # the replicas' task: each group's rewards are recomputed with its functions, and a group whose
    # rewards differ is dropped, its worker banned (support/reward_check.py; none given: off)
    add_task_flags(p)
    args = p.parse_args(argv)
    if too_small := [f for f in ("save_every", "micro_batch_tokens") if getattr(args, f) < 1]:
        sys.exit(f"trainer.py: error: --{too_small[0].replace('_', '-')} must be >= 1")
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if args.delta is not None and not args.delta >= 1 + high:
        sys.exit(f"trainer.py: error: --delta {args.delta:g} must be >= 1 + epsilon_high = "
                 f"{1 + high:g} (raise it, or --delta none to turn TRL's two-sided clip off)")
    lo, hi = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if (None not in (lo, hi) and lo >= hi) or (
            (lo, hi) == (None, None) and args.vllm_importance_sampling_mode.endswith("truncate")):
        sys.exit(f"trainer.py: error: --vllm-importance-sampling-clip-min {lo} and -max {hi}: "
                 "min must be below max, and a *_truncate mode needs one of them (as TRL's "
                 "GRPOConfig)")
    # trainer.py hands args.task to reward_check.TaskRewards: the task flags as one dict (None:
    # no task, the check is off), loaded here so that a bad one stops before anything starts
    try:
        args.task = task_spec(args)
        if args.task:
            make_task(args.task, args.data)
    except TaskError as e:
        sys.exit(f"trainer.py: error: {e}")
    return args


def replica_args(argv=None):
    """rollout.py's flags, checked (a bad value: exit with one line saying what to set)."""
    p = argparse.ArgumentParser(description="A rollout replica: hot-load the newest LoRA from the "
                                "bucket, sample groups, score them, push them.")
    a = p.add_argument
    a("--model", required=True,
      help="base model: a hub id or a local folder (the trainer's --model)")
    a("--bucket", help="where the trainer publishes adapters: a directory or s3://bucket/prefix")
    a("--proxy",
      help="proxy URL, e.g. http://127.0.0.1:8000 (token from --token or env PROXY_TOKEN)")
    a("--token", default=os.environ.get("ROLLOUT_TOKEN"),
      help="the proxy's token (env ROLLOUT_TOKEN else PROXY_TOKEN)")
    add_task_flags(p, default_task=DEFAULTS["task"])  # rollout.py: rewards.task_spec(args, it)
    # The run's contract comes from the proxy (GET /config); these flags only double-check it
    # (--eval, which asks no proxy: --max-completion-length 128 unless given).
    add_contract_checks(p, ("num_generations", "max_completion_length", "temperature",
                            "max_staleness"))
    add_rows(p, "rollout")  # the engine, the replicas, polling, vLLM's memory, --eval's
    a("--dtype", choices=["float32", "bfloat16", "float16"],
      help="--engine hf: the weights' dtype (default: the card's, as the trainer's: bfloat16, "
           "float16 below compute capability 8.0, float32 on a CPU; vllm ignores it). bfloat16 "
           "against an fp32 trainer: a real sampler/learner mismatch (docs/sampler-mismatch.md)")
    a("--cache-dir", help="where pulled adapters go (default: a fresh temporary folder)")
    a("--eval", action="store_true",
      help="measure greedy accuracy on the test split instead of training")
    a("--eval-out", help="--eval: JSON file for the result (default runs/eval-TASK-ADAPTER.json)")
    a("--no-eval-cache", action="store_true",
      help="--eval --adapter base: compute even when a result is cached")
    args = p.parse_args(argv)
    if not 0 <= args.replica_id < args.num_replicas:
        p.error(f"--replica-id {args.replica_id} must be in 0..{args.num_replicas - 1} "
                "(--num-replicas)")
    if not args.eval and not (args.bucket and args.proxy):
        p.error("--bucket (a directory or s3://bucket/prefix) and --proxy (http://host:port) "
                "are required")
    if args.eval and args.max_completion_length is None:
        args.max_completion_length = 128
    if args.adapter not in ("base", "latest") and not args.adapter.isdigit():
        p.error(f"--adapter {args.adapter!r}: use base, latest or a version number")
    return args


def proxy_args(argv=None):
    """proxy.py's flags: the run's contract (its rows, served by GET /config) and the service's
    own (where it listens, what it holds, how long it waits)."""
    p = argparse.ArgumentParser(description="The hub of an async GRPO run: contract, rollout "
                                "buffer, quota. Fields and status codes: docs/protocol.md.")
    a = p.add_argument
    add_rows(p, "contract")  # every role takes these from GET /config
    add_rows(p, "proxy")
    a("--max-body-mb", type=float, help="largest request body in MiB, 413 above (default: "
      "groups-per-step groups at full length, ~64 bytes a token: 2.5 at the default contract)")
    a("--stats-file", help="write the final /stats there (JSON) when the proxy stops")
    a("--token", default=os.environ.get("PROXY_TOKEN"),
      help="the trainer's token, sent as X-Proxy-Token (default: $PROXY_TOKEN)")
    a("--rollout-token", default=os.environ.get("ROLLOUT_TOKEN"),
      help="the replicas' shared secret R (default: $ROLLOUT_TOKEN); it also checks bound "
           "credentials")
    # not the server: jobs.sh mints each replica's credential with it (scripts/jobs_lib.sh)
    a("--print-replica-token", metavar="WORKER",
      help="print the credential bound to WORKER under --rollout-token, and exit")
    return p.parse_args(argv)
