"""Every default of a run, written once: one row per setting, read by jobs.sh, the CLIs and the
proxy.

    python -m support.defaults                 # the table: each setting's default by mode
    python -m support.defaults --shell local   # jobs.sh's `: "${VAR:=value}"` lines (or hf)

A row: TRL's name (the flag's, --max-steps for max_steps), jobs.sh's variable, the type, the
code's default (TRL's where TRL has one), then the value `bash jobs.sh --local` and Hugging Face
Jobs use, each only where it differs from the code's, the roles that take it, and the flag's help
(support/cli.py makes each role's flags from its rows). A role: "contract" (proxy.py's flag,
served by GET /config to the others), "trainer", "rollout", "proxy" (proxy.py's own), "jobs.sh",
"proxy-env" (the proxy's environment on Jobs). Values are written as jobs.sh prints them ("3e-4";
"none": off, "on"/"off": a --flag / --no-flag pair); DEFAULTS holds them typed. A row without a
variable: a flag that jobs.sh leaves at its default (TRAINER_ARGS="--epsilon-high 0.28" sets
one). The standard library only: jobs.sh runs this with any python3 (3.8+), before setup.sh has
made .venv. This module imports nothing of the project.
"""

import sys
from collections import namedtuple

Setting = namedtuple("Setting", "name var type default local hf role help choices")


def row(name, var, type_, default, local=None, hf=None, role="trainer", help="", choices=None):
    return Setting(name, var, type_, default, local, hf, role, help, choices)


def pair(text):
    """reward_range's "LO HI" as [lo, hi]."""
    return [float(x) for x in text.split()]


def float_or_none(text):
    """A float, or "none": None (the setting is off). Also the type of the trainer's flags."""
    return None if text.lower() == "none" else float(text)


def on_off(text):
    """"on" or "off" as a bool: the default of a --flag / --no-flag pair."""
    return {"on": True, "off": False}[text]


TABLE = (
    # the run's contract: proxy.py's flags, served by GET /config to the replicas and the trainer
    # (support/contract.CONTRACT, in this order)
    row("num_generations", "NUM_GENERATIONS", int, "8", role="contract",
        help="completions per prompt, G"),
    row("groups_per_step", "GROUPS_PER_STEP", int, "16", local="4", role="contract",
        help="groups (prompts) the trainer takes per optimizer step, B"),
    row("max_staleness", "MAX_STALENESS", int, "4", local="2", role="contract",
        help="a group of version v is usable while trainer_version - v <= this (0: synchronous)"),
    row("temperature", "TEMPERATURE", float, "1.0", role="contract",
        help="sampling temperature, top_k=0 and top_p=1.0 always (the trainer divides its "
             "logits by it)"),
    row("max_completion_length", "MAX_COMPLETION_LENGTH", int, "256", local="12", role="contract",
        help="longest completion, in tokens; dr_grpo's normaliser (old name: --max-new-tokens)"),
    row("zero_variance", "ZERO_VARIANCE", str, "keep", role="contract", choices=("keep", "drop"),
        help="groups with equal rewards: keep (they count toward a step, as TRL) or drop (DAPO)"),
    row("max_prompt_length", None, int, "1024", role="contract",
        help="longest prompt a group may carry, in tokens (TRL's old GRPOConfig name)"),
    row("reward_range", None, pair, "-1e6 1e6", role="contract",
        help="LO HI: every reward lies in [LO, HI] (default: any finite number a reward function "
             "returns, as TRL, within bounds that keep the squares in an std finite in float32; "
             "e.g. 0 1 for rewards that score 0 or 1)"),
    # trainer.py: the optimizer and the LoRA
    row("max_steps", "STEPS", int, "500", local="30", hf="200",
        help="stop after this many optimizer steps (counted across restarts)"),
    row("learning_rate", "LEARNING_RATE", float, "3e-4", hf="5e-5",
        help="AdamW's initial learning rate"),
    row("lr_scheduler_type", "LR_SCHEDULER_TYPE", str, "linear", choices=("linear", "constant"),
        help="linear: decays to 0 at --max-steps (TRL's default); constant"),
    row("weight_decay", None, float, "0.0", help="AdamW's weight decay (TRL's default: 0)"),
    row("max_grad_norm", None, float, "1.0",
        help="clip the LoRA gradient's global norm to this (TRL's default)"),
    row("lora_r", "LORA_R", int, "16", help="LoRA rank (vLLM wants 1, 8, 16, 32, 64, ...)"),
    row("lora_alpha", "LORA_ALPHA", int, "32", help="LoRA alpha (scale = alpha / r)"),
    row("lora_target", None, str, "all-linear",
        help="'all-linear' or comma-separated module names, e.g. q_proj,v_proj"),
    # the loss (grpo_loss.policy_loss), TRL's defaults but delta's
    row("loss_type", "LOSS_TYPE", str, "dapo", choices=("grpo", "bnpo", "dr_grpo", "dapo"),
        help="loss normalisation, as in TRL"),
    row("scale_rewards", None, str, "group", choices=("group", "batch", "none"),
        help="divide advantages by this std"),
    row("epsilon", None, float, "0.2", help="lower clip: ratio >= 1 - epsilon"),
    row("epsilon_high", None, float_or_none, "none",
        help="upper clip: ratio <= 1 + epsilon_high (default: epsilon)"),
    # TRL's: none (off). Above delta no token has a gradient, so a group whose log-probs make
    # its ratio absurd cannot steer a step (trainer.py, departure 8); >= 1 + epsilon_high
    row("delta", None, float_or_none, "2.0",
        help="TRL's two-sided clip: ratio <= delta (>= 1 + epsilon_high) if advantage < 0; "
             "'none': off (default %(default)s: one group cannot steer a step)"),
    row("beta", "BETA", float, "0.0",
        help="KL coefficient against the base model (adapter disabled); 0 = no KL"),
    row("use_bias_correction_kl", None, on_off, "on",
        help="with --beta > 0: multiply the per-token KL by the importance ratio (TRL's "
             "default: on)"),
    row("mask_truncated_completions", None, on_off, "off",
        help="leave completions that ended without EOS out of the loss (TRL's; default: off)"),
    # the ratio's old policy: locally an fp32 replica = the fp32 trainer, no mismatch to correct;
    # on GPUs vLLM's bf16 sampler != the trainer: TRL's correction (docs/sampler-mismatch.md)
    row("old_logprobs", "OLD_LOGPROBS", str, "sampler", hf="learner",
        choices=("sampler", "learner"),
        help="the ratio's old policy. sampler: the replica's log-probs, no weight (TRL's "
             "AsyncGRPOTrainer; jobs.sh --local's). learner (jobs.sh's on GPUs): the trainer's "
             "own at this step (no extra forward), the loss weighted as below (TRL's "
             "GRPOTrainer with vLLM)"),
    # its weights and mask (grpo_loss.sampler_correction), TRL's defaults
    row("vllm_importance_sampling_correction", None, on_off, "on",
        help="with --old-logprobs learner: weight each token's loss by pi_learner / pi_sampler "
             "(TRL's default: on); the weights are logged in either mode"),
    row("vllm_importance_sampling_mode", "VLLM_IMPORTANCE_SAMPLING_MODE", str, "sequence_mask",
        choices=("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
        help="token_*: a weight per token, sequence_*: one per completion (the product); "
             "*_truncate: held in [min, max], *_mask: 0 outside it (TRL's default)"),
    row("vllm_importance_sampling_clip_max", None, float_or_none, "3.0",
        help="the weight's upper bound C_max ('none': no bound; default %(default)s, as TRL)"),
    row("vllm_importance_sampling_clip_min", None, float_or_none, "none",
        help="the weight's lower bound C_min (default none, as TRL)"),
    row("off_policy_mask_threshold", None, float_or_none, "none",
        help="DeepSeek-V3.2's off-policy sequence mask: leave out a completion with negative "
             "advantage whose mean log(pi_sampler / pi_learner) is above this, e.g. 0.5 "
             "(default none: off, as TRL)"),
    # trainer.py: memory, saving, the run's patience
    row("micro_batch_tokens", "MICRO_BATCH_TOKENS", int, "8192", hf="2048",  # one group on an L4
        help="tokens (padding counted) per forward/backward pass"),
    row("gradient_checkpointing", None, on_off, "off",
        help="recompute each layer's activations in the backward pass instead of keeping them "
             "(TRL's name): less memory per micro-batch, ~1/3 more compute (docs/gpu-round.md)"),
    row("fsdp", None, on_off, "off",
        help="under torchrun: FSDP2 (fully_shard per decoder layer + root), each rank holds 1/N "
             "of the model, for one that does not fit one GPU; the plain forward "
             "(docs/hf-jobs.md)"),
    row("save_every", "SAVE_EVERY", int, "10", local="5",
        help="save resume state every this many steps"),
    row("wait_timeout", None, float, "1800",
        help="seconds with no usable group before giving up (0: never)"),
    row("bucket_retry", None, float, "300",
        help="seconds to retry a bucket that worked before (an outage)"),
    row("report_to", None, str, "none", choices=("none", "trackio", "wandb"),
        help="TRL's: also send each step's metrics there"),
    row("seed", "SEED", int, "0", role="trainer rollout",
        help="the run's seed: the trainer's LoRA init and RNGs; replica i samples with seed + i"),
    # rollout.py
    row("engine", "ENGINE", str, "auto", role="rollout", choices=("auto", "vllm", "hf"),
        help="auto: vllm on a GPU, else hf"),
    row("num_replicas", "REPLICAS", int, "1", role="rollout",
        help="replicas in total (each takes its own slice of prompts)"),
    # --task and the other task flags: support/rewards.add_task_flags (the trainer's: none)
    row("task", "TASK", str, "arith", hf="gsm8k", role="rollout"),
    row("replica_id", None, int, "0", role="rollout",
        help="this replica's index, 0..num-replicas-1"),
    row("prompts_per_batch", None, int, "0", role="rollout",
        help="most prompts per generate call (0: the proxy's whole quota)"),
    row("max_batches", None, int, "0", role="rollout",
        help="stop after this many batches (0 = run forever)"),
    row("poll_interval", None, float, "1.0", role="rollout",
        help="seconds between reads of adapters/LATEST while one is awaited"),
    row("proxy_wait", None, float, "300", role="rollout",
        help="give up on an unreachable proxy after this many seconds"),
    row("max_lora_rank", None, int, "0", role="rollout",
        help="vLLM max_lora_rank (0 = the first adapter's rank)"),
    row("max_model_len", None, int, "0", role="rollout",
        help="vLLM max_model_len (0 = the model's)"),
    row("gpu_memory_utilization", None, float, "0.0", role="rollout",
        help="vLLM's share of GPU memory (0 = vLLM's default, 0.92; lower it when the GPU is "
             "shared)"),
    # rollout.py --eval: greedy accuracy on the held-out split
    row("adapter", None, str, "base", role="rollout",
        help="--eval: base, latest or a version number"),
    row("limit", None, int, "0", role="rollout", help="--eval: first L test problems (0 = all)"),
    row("eval_cache", None, str, "runs/.cache/eval", role="rollout",
        help="--eval --adapter base: result cache"),
    # proxy.py: where it listens, what it holds, how long it waits
    row("host", None, str, "127.0.0.1", role="proxy",
        help="address to listen on; anything but loopback needs a token"),
    row("port", None, int, "8000", role="proxy", help="port to listen on (0: any free port)"),
    row("max_groups", None, int, "4096", role="proxy",
        help="buffer size in groups (429 when full)"),
    row("max_buffer_mb", None, float, "1024", role="proxy",
        help="buffer size in MiB, ~70 bytes a token (429 when full)"),
    row("request_timeout", None, float, "30", role="proxy",
        help="seconds a whole request may take to arrive"),
    row("max_connections", None, int, "256", role="proxy",
        help="open connections at most (503 above)"),
    row("lease_timeout", None, float, "120", role="proxy",
        help="most seconds a replica's lease counts as coming: 1.5x its measured pace (>= 0.5 s) "
             "once it delivered, this until then"),
    row("max_worker_share", None, float, "0.9", role="proxy",  # docs/hostile-peers.md: why 0.9
        help="while other replicas supply groups, the most of a step's groups one worker may "
             "supply, rounded up (default %(default)s; 1: no bound; docs/hostile-peers.md)"),
    row("linger", None, float, "60", role="proxy",
        help="after /done, exit once replicas were told or after this many idle s"),
    # jobs.sh only: the base model every role loads (their --model has no default)
    row("model", "MODEL", str, "HuggingFaceTB/SmolLM2-135M-Instruct",
        hf="Qwen/Qwen2.5-0.5B-Instruct", role="jobs.sh"),
    # the proxy's environment on Jobs (support/proxy_service.run_until_done; locally unset)
    row("trainer_start_timeout", "PROXY_TRAINER_START_TIMEOUT", float, "3600", role="proxy-env"),
    row("trainer_timeout", "PROXY_TRAINER_TIMEOUT", float, "1200", role="proxy-env"),
)
OLD_VARS = {"MAX_COMPLETION_LENGTH": "MAX_NEW_TOKENS"}  # read when the new name is not set
LOCAL_UNSET = ("PROXY_TRAINER_START_TIMEOUT", "PROXY_TRAINER_TIMEOUT")  # locally: the proxy's own
DEFAULTS = {r.name: r.type(r.default) for r in TABLE}  # the code's defaults, typed


def values(mode):
    """{VAR: value as written} of jobs.sh in mode "local" or "hf"."""
    return {r.var: getattr(r, mode) or r.default for r in TABLE
            if r.var and not (mode == "local" and r.var in LOCAL_UNSET)}


def shell(mode):
    """jobs.sh's defaults for mode: one `: "${VAR:=value}"` line each (a variable set wins)."""
    lines = []
    for var, value in values(mode).items():
        assert not set(value) - set("abcdefghijklmnopqrstuvwxyz"
                                    "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789./_-"), value
        if var in OLD_VARS:
            value = f"${{{OLD_VARS[var]}:-{value}}}"
        lines.append(f': "${{{var}:={value}}}"')
    return "\n".join(lines)


def main(argv):
    if argv[:1] == ["--shell"] and argv[1:] in (["local"], ["hf"]):
        print(shell(argv[1]))
        return
    if argv:
        sys.exit("usage: python -m support.defaults [--shell local|hf]")
    rows = [(r.var or "--" + r.name.replace("_", "-"), r.default, r.local or "", r.hf or "",
             r.role) for r in TABLE]
    rows.insert(0, ("variable / flag", "default", "--local", "HF Jobs", "role"))
    widths = [max(len(x[i]) for x in rows) for i in range(4)]
    for x in rows:
        print("  ".join(c.ljust(w) for c, w in zip(x, widths)) + "  " + x[4])

if __name__ == "__main__":
    main(sys.argv[1:])
