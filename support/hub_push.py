"""The result on the Hub: a run's adapter, as a Hugging Face model repository, with a model card
(sync.py's `push-to-hub`). Not needed to follow a run.

    python sync.py push-to-hub user/my-grpo-lora --bucket runs/local/bucket \
        --base-model HuggingFaceTB/SmolLM2-135M-Instruct --dataset arith --reward-funcs arith
    python sync.py push-to-hub user/my-grpo-lora --bucket s3://my-bucket/run1 --private --version 30
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_push_to_hub.py -q   # a stand-in hub

What it does, as TRL's `push_to_hub` (transformers' Trainer.push_to_hub: create_repo with
exist_ok, then upload_folder of the output folder with the card TRL writes into it):
1. read the newest version (adapters/LATEST) or --version from the bucket, only once every file
   matches its manifest, and with ADAPTER_KEY only once the trainer tagged it (as a replica's
   pull): nothing is read from a torn, planted or changed version, and nothing is uploaded then;
2. the PEFT files (adapter_config.json, adapter_model.safetensors) as they are, but
   base_model_name_or_path set to --base-model when one is given (a local run trains from a
   folder; the Hub id is what others can load);
3. README.md, the model card: TRL's (trl/templates/lm_model_card.md) for a PEFT adapter: YAML
   with base_model, datasets, library_name: peft, tags trl, grpo, lora; the base model, the
   dataset or task, the reward functions, the steps and the step's metrics from the bucket;
4. HfApi.create_repo(repo_id, private=True or None, exist_ok=True), then one upload_folder commit.

The token: `token`, else huggingface_hub's own (HF_TOKEN, else `hf auth login`'s), with write
access to the repository's namespace; never printed. Nothing is sent before the adapter is read
and verified and a token found. This module imports no role file.
"""

import json
import os
import sys
import tempfile
import time

from support.adapter_tags import check_adapter, check_latest, read_latest
from support.buckets import (MANIFEST, METRICS_KEY, RECORD_MAX_BYTES, BucketError, as_bucket,
                             fetch_verified, parse_json)

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what PeftModel loads
TAGS = ("trl", "grpo", "lora")  # TRL's GRPOTrainer._tag_names, and PEFT's tag for a LoRA
# the step record's fields the card shows first (support/step_record.py), then TRL's rewards/*
CARD_METRICS = ("reward_mean", "reward_std", "kl", "groups", "groups_zero_variance",
                "groups_dropped", "clipped_ratio", "staleness_mean", "tokens", "grad_norm",
                "learning_rate")
DATA_FILES = (".jsonl", ".json", ".parquet", ".csv")  # a dataset given as a file: not a Hub id
EVAL_FIELDS = ("accuracy", "reward_mean")  # of an --eval result, those it has
GRPO_PAPER = ("DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language "
              "Models", "2402.03300")  # TRL's GRPOTrainer._paper


class HubError(Exception):
    """The push cannot go on: no token, a repository id the Hub refuses, the Hub's answer."""


# ---- 1. the adapter, verified, and its step's record

def verified_adapter(bucket, version=None, key=None, timeout=10.0):
    """(version, {name: bytes} with manifest.json) of LATEST's version or `version`, once every
    file matches the manifest (waiting up to timeout s for a mount); with key (ADAPTER_KEY) only
    if the trainer tagged LATEST and the version. BucketError (CorruptAdapter: changed after its
    manifest; Untrusted: no tag) otherwise, and when there is no version at all."""
    b = as_bucket(bucket)
    if version is None:
        version, value = read_latest(b)
        if version is None:
            raise BucketError(f"{b.url} holds no adapter (no adapters/LATEST): nothing to push; "
                              "train first, or pass the bucket the run wrote")
        if key:
            check_latest(value, key, b.url)
    # with key, the tag is checked before any file is read (as a replica's pull does)
    check = (lambda raw: check_adapter(raw, version, key, b.url)) if key else None
    files = fetch_verified(b, f"adapters/v{version:06d}/", timeout, f"adapter v{version:06d}",
                           check)
    missing = [n for n in PEFT_FILES if n not in files]
    if missing:
        raise BucketError(f"{b.url}: adapter v{version:06d} has no {', '.join(missing)}: not "
                          "a PEFT folder (trainer.py publishes what save_pretrained writes)")
    return version, files


def step_record(bucket, step):
    """(S, metrics/step-S.json's record) for the adapter's step S, else for the newest record
    before it (one lost to a mount); None when there is none."""
    b = as_bucket(bucket)
    keys = {int(m.group(1)): k for k in b.list("metrics/") if (m := METRICS_KEY.match(k))}
    for s in sorted((s for s in keys if step is None or s <= step), reverse=True):
        try:
            record = parse_json(b.read(keys[s], RECORD_MAX_BYTES), keys[s])
        except BucketError:  # torn on a mount, too large, too deep: the one before
            continue
        if isinstance(record, dict):
            return s, record
    return None


# ---- 2.-3. what the repository holds: the PEFT files and the model card

def is_hub_id(name):
    """A Hub repository id (namespace/name or name), not a local path: TRL writes base_model only
    when the model was not a local folder."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(name, str) or os.path.exists(name) or name.endswith(DATA_FILES):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _number(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def model_card(repo_id, base_model, version, manifest, record=None, dataset=None,
               reward_funcs=(), reward_weights=None, peft_version=None, evals=()):
    """README.md for the repository: TRL's lm_model_card.md (YAML metadata, then the model, a
    quick start, the training procedure), for a PEFT adapter and with the run's numbers. record:
    step_record's (S, record) or None; evals: rollout.py --eval results (JSON objects)."""
    from huggingface_hub import ModelCardData

    hub_base = base_model if is_hub_id(base_model) else None
    tags = [*TAGS, *([f"base_model:adapter:{hub_base}"] if hub_base else [])]
    # a built-in task's name (arith, gsm8k) is no dataset: only namespace/name ids are listed
    hub_data = [dataset] if is_hub_id(dataset) and "/" in dataset else None
    data = ModelCardData(base_model=hub_base, datasets=hub_data,
                         library_name="peft", model_name=repo_id.split("/")[-1],
                         pipeline_tag="text-generation", tags=tags)
    base_link = f"[{hub_base}](https://huggingface.co/{hub_base})" if hub_base else (
        f"`{base_model}` (a local folder)")
    weights = list(reward_weights or [1.0] * len(reward_funcs))
    funcs = ", ".join(f"`{f}`" + (f" (weight {_number(w)})" if reward_weights else "")
                      for f, w in zip(reward_funcs, weights)) or "not recorded"
    step, created = manifest.get("step"), manifest.get("created")
    try:  # the manifest's numbers are the bucket's: anything but a time is left out
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(created))
    except (TypeError, ValueError, OverflowError, OSError):
        when = "-"
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# Model Card for {repo_id.split('/')[-1]}", "",
        f"This model is a LoRA adapter for {base_link}, trained with GRPO on "
        f"{f'`{dataset}`' if dataset else 'a dataset not recorded'}"
        f"{f' with the reward functions {funcs}' if reward_funcs else ''}. It has been trained "
        "with async GRPO over a bucket and a proxy (TRL's names for every setting).", "",
        "## Quick start", "", "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        f'base = AutoModelForCausalLM.from_pretrained("{base_model}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{base_model}")',
        f'model = PeftModel.from_pretrained(base, "{repo_id}")', "```", "",
        "## Training procedure", "",
        f"This model was trained with GRPO, a method introduced in [{GRPO_PAPER[0]}]"
        f"(https://huggingface.co/papers/{GRPO_PAPER[1]}).", "",
        f"- Base model: {base_link}",
        f"- Dataset / task: {f'`{dataset}`' if dataset else 'not recorded'}",
        f"- Reward functions: {funcs}",
        f"- Steps: {step if step is not None else 'not recorded'} (adapter version "
        f"v{version:06d}, published {when})", ""]
    if record:
        s, record = record
        rows = [k for k in CARD_METRICS if k in record] + sorted(
            k for k in record if k.startswith("rewards/"))  # TRL's per-function rewards
        lines += [f"### Metrics at step {s} (metrics/step-{s:06d}.json in the run's bucket)", "",
                  "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_number(record[k])} |" for k in rows
                  if isinstance(record[k], (int, float))]
        lines.append("")
    else:
        lines += ["No step record (metrics/step-*.json) was found in the run's bucket.", ""]
    if evals:  # rollout.py --eval's results (jobs.sh --local: eval-base.json, eval-final.json)
        lines += ["### Held-out evaluation (rollout.py --eval, greedy)", "",
                  "| adapter | n | " + " | ".join(EVAL_FIELDS) + " |",
                  "|---|---|" + "---|" * len(EVAL_FIELDS)]
        for e in evals:
            which = e.get("adapter") if e.get("version") is None else (
                f"{e.get('adapter')} (v{e['version']})")
            values = " | ".join(_number(e.get(k, "-")) for k in EVAL_FIELDS)
            lines.append(f"| {which} | {e.get('n')} | {values} |")
        lines.append("")
    lines += ["### Framework versions", "", f"- PEFT: {peft_version or 'not recorded'}", ""]
    return "\n".join(lines)


def hub_files(files, version, base_model=None):
    """{name: bytes} for the repository: PEFT_FILES (not the manifest, nor PEFT's generic
    README.md), base_model_name_or_path set to base_model when given; and the config."""
    out = {n: files[n] for n in PEFT_FILES}
    try:
        config = json.loads(out["adapter_config.json"])
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise BucketError(f"adapter v{version:06d}: adapter_config.json is not a JSON object")
    if base_model and config.get("base_model_name_or_path") != base_model:
        config["base_model_name_or_path"] = base_model
        out["adapter_config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    return out, config


def eval_result(path):
    """One rollout.py --eval result file (JSON object); HubError if it is not one."""
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        raise HubError(f"--eval {path}: {e}") from None
    if not isinstance(result, dict):
        raise HubError(f"--eval {path}: not a rollout.py --eval result (a JSON object)")
    return result


# ---- 4. the push

def push_to_hub(bucket, repo_id, private=False, version=None, token=None, endpoint=None,
                base_model=None, dataset=None, reward_funcs=(), reward_weights=None, key=None,
                timeout=10.0, evals=()):
    """Upload the adapter (LATEST's version, or `version`) and its model card to the Hub model
    repository repo_id, created if needed (private=True: private; else the namespace's default).
    base_model: the Hub id to record (default: the manifest's, the trainer's --model). Returns
    the commit's URL. evals: rollout.py --eval result files, shown in the card. BucketError
    before anything is sent if the adapter is missing or does not verify; HubError without a
    token, for an unreadable evals file, or on the Hub's refusal."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubError(f"{repo_id!r} is not a Hub repository id (user/name or org/name): "
                       f"{e}") from None
    version, files = verified_adapter(bucket, version, key, timeout)
    manifest = json.loads(files[MANIFEST])
    if type(manifest.get("step")) is not int:  # the bucket's: not a step is none
        manifest["step"] = None
    if reward_weights and len(reward_weights) != len(reward_funcs):
        raise HubError(f"{len(reward_weights)} reward weights for {len(reward_funcs)} reward "
                       "functions: give one weight per function, or none")
    repo_files, config = hub_files(files, version, base_model)
    evals = [eval_result(path) for path in evals]
    base = base_model or manifest.get("base_model") or config.get("base_model_name_or_path")
    if not is_hub_id(base):
        print(f"sync.py push-to-hub: the base model {base!r} is a local folder, not a Hub id: "
              "the card names it but leaves base_model out of its metadata; pass --base-model "
              "HUB_ID (the folder's model on the Hub) so that others can load the adapter",
              file=sys.stderr)
    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token: set HF_TOKEN to a token with write access to "
                       f"{repo_id.split('/')[0] if '/' in repo_id else 'your namespace'} "
                       "(https://huggingface.co/settings/tokens), or run `hf auth login`")
    api = HfApi(endpoint=endpoint, token=token)
    try:
        url = api.create_repo(repo_id, private=private or None, exist_ok=True)
        card = model_card(url.repo_id, base, version, manifest,
                          step_record(bucket, manifest["step"]), dataset, list(reward_funcs),
                          reward_weights, config.get("peft_version"), evals)
        with tempfile.TemporaryDirectory(prefix="hub-push-") as d:
            for name, data in {**repo_files, "README.md": card.encode()}.items():
                with open(os.path.join(d, name), "wb") as f:
                    f.write(data)
            commit = api.upload_folder(
                repo_id=url.repo_id, folder_path=d,
                commit_message=f"GRPO adapter v{version:06d} (step {manifest['step']})")
    except (HfHubHTTPError, OfflineModeIsEnabled, HFValidationError) as e:
        raise HubError(f"{repo_id}: {e}") from None
    return commit.commit_url


# ---- the command line: python sync.py push-to-hub REPO_ID --bucket BUCKET ...

def add_arguments(p):
    """push-to-hub's arguments on the (sub)parser p."""
    p.add_argument("repo_id", help="the Hub model repository, user/name or org/name (created "
                   "if it does not exist)")
    p.add_argument("--bucket", required=True, help="the run's bucket: a directory or "
                   "s3://bucket/prefix")
    p.add_argument("--version", type=int, default=None,
                   help="the adapter version to push (default: LATEST, the newest)")
    p.add_argument("--private", action="store_true",
                   help="create the repository private (as `hf repo create --private`); an "
                   "existing repository keeps its visibility")
    p.add_argument("--base-model", default=None, help="the base model's Hub id, recorded in "
                   "the card and in adapter_config.json (default: the trainer's --model)")
    p.add_argument("--dataset", default=None,
                   help="the dataset or task trained on, for the card (TRL's dataset_name)")
    p.add_argument("--reward-funcs", nargs="+", default=[],
                   help="the reward functions, for the card (TRL's reward_funcs)")
    p.add_argument("--reward-weights", nargs="+", type=float, default=None,
                   help="their weights, for the card (TRL's reward_weights)")
    p.add_argument("--eval", nargs="+", action="extend", default=[], metavar="FILE",
                   help="rollout.py --eval results to show in the card (jobs.sh --local: "
                   "RUN/eval-base.json RUN/eval-final.json)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for a version whose files do not match its manifest yet")


def push_from_args(args, key=None):
    """Run push_to_hub for parsed arguments; exits with the error's message on failure."""
    try:
        url = push_to_hub(args.bucket, args.repo_id, private=args.private, version=args.version,
                          base_model=args.base_model, dataset=args.dataset,
                          reward_funcs=args.reward_funcs, reward_weights=args.reward_weights,
                          key=key, timeout=args.timeout, evals=args.eval)
    except (BucketError, HubError) as e:
        sys.exit(f"sync.py push-to-hub: error: {e}")
    print(f"pushed to {url}")

