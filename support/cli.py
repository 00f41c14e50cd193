"""The command lines of the roles: every flag with its help text, checked (a bad value exits
with one line saying what to set). The roles' main() calls these.

This module imports no role file.
"""

import argparse
import os
import sys

from support.contract import CONTRACT, CONTRACT_HELP, OLD_NAMES
from support.defaults import DEFAULTS, float_or_none
from support.rewards import add_task_flags, make_task, task_spec
from support.tasks import TaskError
from support.worker_bounds import MAX_WORKER_SHARE

DELTA = DEFAULTS["delta"]  # --delta's default (trainer.py, departure 8), as bench/ reads it


def trainer_args(argv=None, description=None):
    """trainer.py's flags, checked (a bad value: exit with one line saying what to set)."""
    p = argparse.ArgumentParser(description=description)
    a = p.add_argument
    a("--model", required=True, help="base model: a Hub id or a local folder")
    a("--bucket", required=True, help="a directory (or mounted bucket) or s3://bucket/prefix")
    a("--proxy", required=True,
      help="the proxy's URL, e.g. http://127.0.0.1:8000 (token: env PROXY_TOKEN)")
    # The run's contract comes from the proxy (GET /config); these flags only double-check it.
    a("--num-generations", type=int, help="completions per prompt, G (default: the proxy's)")
    a("--groups-per-step", type=int,
      help="groups (prompts) per optimizer step (default: the proxy's)")
    a("--max-staleness", type=int,
      help="the proxy's staleness bound; sets the versions kept (default: the proxy's)")
    a("--temperature", type=float,
      help="the replicas' sampling temperature; divides logits (default: the proxy's)")
    a("--max-completion-length", type=int,
      help="the longest completion; dr_grpo's normaliser (default: the proxy's)")
    # the loss, as TRL names it
    a("--epsilon", type=float, default=DEFAULTS["epsilon"],
      help="lower clip: ratio >= 1 - epsilon")
    a("--epsilon-high", type=float_or_none, default=DEFAULTS["epsilon_high"],
      help="upper clip: ratio <= 1 + epsilon_high (default: epsilon)")
    a("--delta", type=float_or_none, default=DEFAULTS["delta"],
      help="TRL's two-sided clip: ratio <= delta (>= 1 + epsilon_high) if advantage < 0; "
           "'none': off (default %(default)s: one group cannot steer a step)")
    a("--beta", type=float, default=DEFAULTS["beta"],
      help="KL coefficient against the base model (adapter disabled); 0 = no KL")
    a("--use-bias-correction-kl", action=argparse.BooleanOptionalAction,
      default=DEFAULTS["use_bias_correction_kl"],
      help="with --beta > 0: multiply the per-token KL by the importance ratio (TRL's default: on)")
    a("--mask-truncated-completions", action="store_true",
      help="leave completions that ended without EOS out of the loss (TRL's; default: off)")
    # where the sampler's log-probs enter the loss (grpo_loss.sampler_correction; TRL's names)
    a("--old-logprobs", default=DEFAULTS["old_logprobs"], choices=["sampler", "learner"],
      help="the ratio's old policy. sampler: the replica's log-probs, no weight (TRL's "
           "AsyncGRPOTrainer; jobs.sh --local's). learner (jobs.sh's on GPUs): the "
           "trainer's own at this step (no extra forward), the loss weighted as below (TRL's "
           "GRPOTrainer with vLLM)")
    a("--vllm-importance-sampling-correction", action=argparse.BooleanOptionalAction,
      default=DEFAULTS["vllm_importance_sampling_correction"],
      help="with --old-logprobs learner: weight each token's loss by pi_learner / pi_sampler "
           "(TRL's default: on); the weights are logged in either mode")
    a("--vllm-importance-sampling-mode", default=DEFAULTS["vllm_importance_sampling_mode"],
      choices=["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"],
      help="token_*: a weight per token, sequence_*: one per completion (the product); "
           "*_truncate: held in [min, max], *_mask: 0 outside it (TRL's default: sequence_mask)")
    a("--vllm-importance-sampling-clip-max", type=float_or_none,
      default=DEFAULTS["vllm_importance_sampling_clip_max"],
      help="the weight's upper bound C_max ('none': no bound; default %(default)s, as TRL)")
    a("--vllm-importance-sampling-clip-min", type=float_or_none,
      default=DEFAULTS["vllm_importance_sampling_clip_min"],
      help="the weight's lower bound C_min (default none, as TRL)")
    a("--off-policy-mask-threshold", type=float_or_none,
      default=DEFAULTS["off_policy_mask_threshold"],
      help="DeepSeek-V3.2's off-policy sequence mask: leave out a completion with negative "
           "advantage whose mean log(pi_sampler / pi_learner) is above this, e.g. 0.5 "
           "(default none: off, as TRL)")
    a("--loss-type", default=DEFAULTS["loss_type"], choices=["grpo", "bnpo", "dr_grpo", "dapo"],
      help="loss normalisation, as in TRL")
    a("--scale-rewards", default=DEFAULTS["scale_rewards"], choices=["group", "batch", "none"],
      help="divide advantages by this std")
    a("--learning-rate", type=float, default=DEFAULTS["learning_rate"],
      help="AdamW's initial learning rate")
    a("--lr-scheduler-type", default=DEFAULTS["lr_scheduler_type"], choices=["linear", "constant"],
      help="linear: decays to 0 at --max-steps (TRL's default); constant")
    a("--max-grad-norm", type=float, default=DEFAULTS["max_grad_norm"],
      help="clip the LoRA gradient's global norm to this")
    a("--max-steps", type=int, default=DEFAULTS["max_steps"],
      help="stop after this many optimizer steps (counted across restarts)")
    a("--micro-batch-tokens", type=int, default=DEFAULTS["micro_batch_tokens"],
      help="tokens (padding counted) per forward/backward pass")
    a("--gradient-checkpointing", action="store_true",
      help="recompute each layer's activations in the backward pass instead of keeping them "
           "(TRL's name): less memory per micro-batch, ~1/3 more compute (docs/gpu-round.md)")
    a("--fsdp", action="store_true",
      help="under torchrun: FSDP2 (fully_shard per decoder layer + root), each rank holds 1/N of "
           "the model, for one that does not fit one GPU; the plain forward (docs/hf-jobs.md)")
    a("--save-every", type=int, default=DEFAULTS["save_every"],
      help="save resume state every this many steps")
    a("--seed", type=int, default=DEFAULTS["seed"],
      help="seed for the LoRA init and torch's/python's RNGs")
    a("--lora-r", type=int, default=DEFAULTS["lora_r"],
      help="LoRA rank (vLLM wants 1, 8, 16, 32, 64, ...)")
    a("--lora-alpha", type=int, default=DEFAULTS["lora_alpha"],
      help="LoRA alpha (scale = alpha / r)")
    a("--lora-target", default=DEFAULTS["lora_target"],
      help="'all-linear' or comma-separated module names, e.g. q_proj,v_proj")
    a("--wait-timeout", type=float, default=DEFAULTS["wait_timeout"],
      help="seconds with no usable group before giving up (0: never)")
    a("--bucket-retry", type=float, default=DEFAULTS["bucket_retry"],
      help="seconds to retry a bucket that worked before (an outage)")
    a("--report-to", default=DEFAULTS["report_to"], choices=["none", "trackio", "wandb"],
      help="also send each step's metrics there")
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
    # The run's contract comes from the proxy (GET /config); these flags only double-check it.
    a("--num-generations", type=int, help="completions per prompt, G (default: the proxy's)")
    a("--max-completion-length", "--max-new-tokens", type=int,
      help="longest completion (default: the proxy's; with --eval: 128); old name: "
           "--max-new-tokens")
    a("--temperature", type=float,
      help="sampling temperature, top_k=0 and top_p=1.0 always (default: the proxy's)")
    a("--max-staleness", type=int, help="the proxy's staleness bound (default: the proxy's)")
    a("--prompts-per-batch", type=int, default=0,
      help="most prompts per generate call (0: the proxy's whole quota)")
    a("--engine", default=DEFAULTS["engine"], choices=["auto", "vllm", "hf"],
      help="auto: vllm on a GPU, else hf")
    a("--dtype", choices=["float32", "bfloat16", "float16"],
      help="--engine hf: the weights' dtype (default: the card's, as the trainer's: bfloat16, "
           "float16 below compute capability 8.0, float32 on a CPU; vllm ignores it). bfloat16 "
           "against an fp32 trainer: a real sampler/learner mismatch (docs/sampler-mismatch.md)")
    a("--replica-id", type=int, default=0, help="this replica's index, 0..num-replicas-1")
    a("--num-replicas", type=int, default=DEFAULTS["num_replicas"],
      help="replicas in total (each takes its own slice of prompts)")
    a("--seed", type=int, default=DEFAULTS["seed"], help="base seed; replica i uses seed + i")
    a("--max-batches", type=int, default=0,
      help="stop after this many batches (0 = run forever)")
    a("--poll-interval", type=float, default=1.0,
      help="seconds between reads of adapters/LATEST while one is awaited")
    a("--proxy-wait", type=float, default=300.0,
      help="give up on an unreachable proxy after this many seconds")
    a("--max-lora-rank", type=int, default=0,
      help="vLLM max_lora_rank (0 = the first adapter's rank)")
    a("--max-model-len", type=int, default=0, help="vLLM max_model_len (0 = the model's)")
    a("--gpu-memory-utilization", type=float, default=0.0,
      help="vLLM's share of GPU memory (0 = vLLM's default, 0.92; lower it when the GPU is shared)")
    a("--cache-dir", help="where pulled adapters go (default: a fresh temporary folder)")
    a("--eval", action="store_true",
      help="measure greedy accuracy on the test split instead of training")
    a("--adapter", default="base", help="--eval: base, latest or a version number")
    a("--limit", type=int, default=0, help="--eval: first L test problems (0 = all)")
    a("--eval-out", help="--eval: JSON file for the result (default runs/eval-TASK-ADAPTER.json)")
    a("--eval-cache", default=os.path.join("runs", ".cache", "eval"),
      help="--eval --adapter base: result cache")
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
    """proxy.py's flags: the run's contract (CONTRACT, its help in CONTRACT_HELP) and the
    service's limits."""
    p = argparse.ArgumentParser(description="The hub of an async GRPO run: contract, rollout "
                                "buffer, quota. Fields and status codes: docs/protocol.md.")
    a = p.add_argument
    a("--host", default="127.0.0.1",
      help="address to listen on; anything but loopback needs a token")
    a("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    # the run's contract: every role takes it from GET /config
    for key, default in CONTRACT.items():
        if key in OLD_NAMES:  # an old name: a second spelling of its new name's flag
            continue
        pair = key == "reward_range"  # LO HI
        olds = ["--" + k.replace("_", "-") for k, new in OLD_NAMES.items() if new == key]
        a("--" + key.replace("_", "-"), *olds, type=float if pair else type(default),
          default=default, help=CONTRACT_HELP[key],
          choices=("keep", "drop") if key == "zero_variance" else None,
          nargs=2 if pair else None, metavar=("LO", "HI") if pair else None)
    a("--max-groups", type=int, default=4096, help="buffer size in groups (429 when full)")
    a("--max-buffer-mb", type=float, default=1024,
      help="buffer size in MiB, ~70 bytes a token (429 when full)")
    a("--max-body-mb", type=float, help="largest request body in MiB, 413 above (default: "
      "groups-per-step groups at full length, ~64 bytes a token: 2.5 at the default contract)")
    a("--request-timeout", type=float, default=30.0,
      help="seconds a whole request may take to arrive")
    a("--max-connections", type=int, default=256, help="open connections at most (503 above)")
    a("--lease-timeout", type=float, default=120.0,
      help="most seconds a replica's lease counts as coming: 1.5x its measured pace (>= 0.5 s) "
           "once it delivered, this until then")
    a("--max-worker-share", type=float, default=MAX_WORKER_SHARE,
      help="while other replicas supply groups, the most of a step's groups one worker may "
           f"supply, rounded up (default {MAX_WORKER_SHARE}; 1: no bound; docs/hostile-peers.md)")
    a("--linger", type=float, default=60.0,
      help="after /done, exit once replicas were told or after this many idle s")
    a("--stats-file", help="write the final /stats there (JSON) when the proxy stops")
    a("--token", default=os.environ.get("PROXY_TOKEN"),
      help="the trainer's token, sent as X-Proxy-Token (default: $PROXY_TOKEN)")
    a("--rollout-token", default=os.environ.get("ROLLOUT_TOKEN"),
      help="the replicas' shared secret R (default: $ROLLOUT_TOKEN); it also checks bound "
           "credentials")
    a("--print-replica-token", metavar="WORKER",
      help="print the credential bound to WORKER under --rollout-token, and exit")
    return p.parse_args(argv)
