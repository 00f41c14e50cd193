"""Every default of a run, written once: one row per setting, read by jobs.sh, the CLIs and the
proxy.

    python -m support.defaults                 # the table: each setting's default by mode
    python -m support.defaults --shell local   # jobs.sh's `: "${VAR:=value}"` lines (or hf)

A row: TRL's name (the flag's, --max-steps for max_steps), jobs.sh's variable, the type, the
code's default (TRL's where TRL has one), then the value `bash jobs.sh --local` and Hugging Face
Jobs use, each only where it differs from the code's, and the role that takes it. Values are
written as jobs.sh prints them ("3e-4"; "none": off, "on"/"off": a --flag / --no-flag pair);
DEFAULTS holds them typed. A row without a variable: a flag that jobs.sh leaves at its default
(TRAINER_ARGS="--epsilon-high 0.28" sets one). The standard library only: jobs.sh runs this
with any python3 (3.8+), before setup.sh has made .venv. This module imports nothing of the
project.
"""

import sys
from collections import namedtuple

Setting = namedtuple("Setting", "name var type default local hf role")


def row(name, var, type_, default, local=None, hf=None, role="trainer"):
    return Setting(name, var, type_, default, local, hf, role)


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
    row("num_generations", "NUM_GENERATIONS", int, "8", role="proxy"),
    row("groups_per_step", "GROUPS_PER_STEP", int, "16", local="4", role="proxy"),
    row("max_staleness", "MAX_STALENESS", int, "4", local="2", role="proxy"),
    row("temperature", "TEMPERATURE", float, "1.0", role="proxy"),
    row("max_completion_length", "MAX_COMPLETION_LENGTH", int, "256", local="12", role="proxy"),
    row("zero_variance", "ZERO_VARIANCE", str, "keep", role="proxy"),
    row("max_prompt_length", None, int, "1024", role="proxy"),
    row("reward_range", None, pair, "-1e6 1e6", role="proxy"),  # any finite reward, as TRL
    # trainer.py (support/cli.trainer_args)
    row("max_steps", "STEPS", int, "500", local="30", hf="200"),
    row("learning_rate", "LEARNING_RATE", float, "3e-4", hf="5e-5"),
    row("lr_scheduler_type", "LR_SCHEDULER_TYPE", str, "linear"),  # TRL's
    row("max_grad_norm", None, float, "1.0"),  # TRL's
    row("lora_r", "LORA_R", int, "16"),
    row("lora_alpha", "LORA_ALPHA", int, "32"),
    row("lora_target", None, str, "all-linear"),  # or module names: q_proj,v_proj
    # the loss (grpo_loss.policy_loss), TRL's defaults but delta's
    row("loss_type", "LOSS_TYPE", str, "dapo"),
    row("scale_rewards", None, str, "group"),
    row("epsilon", None, float, "0.2"),
    row("epsilon_high", None, float_or_none, "none"),  # none: epsilon
    # TRL's: none (off). Above delta no token has a gradient, so a group whose log-probs make
    # its ratio absurd cannot steer a step (trainer.py, departure 8); >= 1 + epsilon_high
    row("delta", None, float_or_none, "2.0"),
    row("beta", "BETA", float, "0.0"),
    row("use_bias_correction_kl", None, on_off, "on"),
    row("save_every", "SAVE_EVERY", int, "10", local="5"),
    row("micro_batch_tokens", "MICRO_BATCH_TOKENS", int, "8192", hf="2048"),  # one group on an L4
    # the ratio's old policy: locally an fp32 replica = the fp32 trainer, no mismatch to correct;
    # on GPUs vLLM's bf16 sampler != the trainer: TRL's correction (docs/sampler-mismatch.md)
    row("old_logprobs", "OLD_LOGPROBS", str, "sampler", hf="learner"),
    # its weights and mask (grpo_loss.sampler_correction), TRL's defaults
    row("vllm_importance_sampling_correction", None, on_off, "on"),
    row("vllm_importance_sampling_mode", "VLLM_IMPORTANCE_SAMPLING_MODE", str,
        "sequence_mask"),
    row("vllm_importance_sampling_clip_max", None, float_or_none, "3.0"),
    row("vllm_importance_sampling_clip_min", None, float_or_none, "none"),
    row("off_policy_mask_threshold", None, float_or_none, "none"),  # none: off
    row("wait_timeout", None, float, "1800"),  # s with no usable group, then stop; 0: never
    row("bucket_retry", None, float, "300"),  # s to retry a bucket that worked before
    row("report_to", None, str, "none"),  # TRL's: also send the metrics to trackio, wandb
    row("seed", "SEED", int, "0", role="trainer rollout"),
    # rollout.py (support/cli.replica_args)
    row("engine", "ENGINE", str, "auto", role="rollout"),
    row("num_replicas", "REPLICAS", int, "1", role="rollout"),
    row("task", "TASK", str, "arith", hf="gsm8k", role="rollout"),  # the trainer's: none
    # jobs.sh only: the base model every role loads (their --model has no default)
    row("model", "MODEL", str, "HuggingFaceTB/SmolLM2-135M-Instruct",
        hf="Qwen/Qwen2.5-0.5B-Instruct", role="jobs.sh"),
    # the proxy's environment on Jobs (support/proxy_service.run_until_done; locally unset)
    row("trainer_start_timeout", "PROXY_TRAINER_START_TIMEOUT", float, "3600", role="proxy env"),
    row("trainer_timeout", "PROXY_TRAINER_TIMEOUT", float, "1200", role="proxy env"),
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
