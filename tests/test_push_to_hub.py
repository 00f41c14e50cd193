"""push-to-hub (support/hub_push.py) against a stand-in Hugging Face Hub on 127.0.0.1.

    cd /work/main && OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_push_to_hub.py -q

The stand-in (StandInHub) is a real HTTP server answering just what huggingface_hub 2.4's
HfApi.create_repo and HfApi.upload_folder send (read in the installed client: hf_api.py
create_repo, _upload_pipeline.py, _commit_api.py _fetch_upload_modes and _send_commit):
    POST /api/repos/create                       {"name", "organization", "visibility"?}
    POST /api/models/{repo}/preupload/{rev}      -> each file's "uploadMode"
    POST /api/models/{repo}/commit/{rev}         the commit as NDJSON, regular files inline
    POST /api/validate-yaml                      the card's metadata, checked before upload
It answers every preupload with "regular", so the client puts every file's bytes into the
commit itself. The real Hub answers "lfs" for adapter_model.safetensors (*.safetensors is an LFS
pattern), and the client then uploads it through Xet storage: that part only an account runs
(docs/hub.md). The push runs as `python sync.py push-to-hub` would, in a subprocess, with
HF_ENDPOINT pointed at the stand-in, and the adapter is published into a directory bucket as
trainer.publish does it. Nothing of hub_push.py or of huggingface_hub is mocked.
"""

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import sync
from conftest import ROOT, make_lora_model
from support import buckets, hub_push

TOKEN = "hf_standin_write_token_0123456789"  # the stand-in's one valid token; never printed
BASE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the Hub id the card records for the tiny model
PUSH = [sys.executable, "sync.py", "push-to-hub"]


class StandInHub:
    """A model-repository store behind the endpoints above: repos[repo_id] = {"private",
    "files": {path: bytes}, "commits": [summary]}; requests: every (method, path) received."""

    def __init__(self, user="standin-user"):
        self.user, self.repos, self.requests, self.lock = user, {}, [], threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def answer(self, status, body, headers=()):
                data = json.dumps(body).encode()
                self.send_response(status)
                for k, v in [("Content-Type", "application/json"), *headers]:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                hub.requests.append(("GET", self.path))
                self.answer(404, {"error": f"the stand-in does not serve GET {self.path}"})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with hub.lock:
                    hub.requests.append(("POST", self.path))
                    if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                        return self.answer(401, {"error": "Invalid credentials in Authorization "
                                                 "header"})
                    self.answer(*hub.post(self.path.split("?")[0], body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def post(self, path, body):
        """(status, JSON answer[, headers]) for one POST, as the Hub answers it."""
        if path == "/api/repos/create":
            req = json.loads(body)
            repo_id = f"{req.get('organization') or self.user}/{req['name']}"
            if req.get("type", "model") != "model":
                return 400, {"error": "the stand-in holds model repositories only"}
            if repo_id in self.repos:  # the Hub's 409 names the existing repository
                return 409, {"error": "You already created this model repo",
                             "url": f"{self.url}/{repo_id}"}
            self.repos[repo_id] = {"private": req.get("visibility") == "private",
                                   "files": {}, "commits": []}
            return 200, {"url": f"{self.url}/{repo_id}", "name": repo_id}
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit)/([^/]+)", path)
        if m is None:
            return (200, {}) if path == "/api/validate-yaml" else (
                404, {"error": f"the stand-in does not serve POST {path}"})
        repo = self.repos.get(m.group(1))
        if repo is None:
            return 404, {"error": "Repository not found"}, [("X-Error-Code", "RepoNotFound")]
        if m.group(2) == "preupload":  # every file inline ("regular"); oid: the stored blob's
            files = repo["files"]
            return 200, {"files": [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                 "oid": git_blob_sha(files[f["path"]]) if f["path"] in files else None}
                for f in json.loads(body)["files"]]}
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        for line in lines[1:]:  # lines[0]: {"key": "header", "value": {"summary", ...}}
            if line["key"] != "file":  # lfsFile: the client chose LFS/Xet, which is not served
                return 400, {"error": f"the stand-in takes regular files only, not {line['key']}"}
            repo["files"][line["value"]["path"]] = base64.b64decode(line["value"]["content"])
        repo["commits"].append(lines[0]["value"]["summary"])
        oid = hashlib.sha1(json.dumps(lines).encode()).hexdigest()
        return 200, {"commitUrl": f"{self.url}/{m.group(1)}/commit/{oid}", "commitOid": oid}

    def snapshot(self, repo_id, folder):
        """The repository's files, written into folder (what a download of it would give)."""
        os.makedirs(folder, exist_ok=True)
        for name, data in self.repos[repo_id]["files"].items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        return folder

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def git_blob_sha(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def hub():
    h = StandInHub()
    yield h
    h.close()


def push(hub, tmp_path, *args, token=TOKEN, **env):
    """`python sync.py push-to-hub ARGS` against the stand-in; the CompletedProcess."""
    full = {k: v for k, v in os.environ.items()
            if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "ADAPTER_KEY")}
    full.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"),  # no stored login
                HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1", **env)
    if token:
        full["HF_TOKEN"] = token
    r = subprocess.run([*PUSH, *map(str, args)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=full)
    assert TOKEN not in r.stdout + r.stderr, "the token was printed"
    return r


def publish(model, bucket, version, step, base):
    """A version as trainer.publish writes it (PEFT's save_pretrained, then sync.publish_adapter
    with base_model and step), and the step's record as step_record.log_step writes it (fewer
    fields)."""
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        sync.publish_adapter(bucket, d, version, keep=4, base_model=base, step=step)
    buckets.append_metrics(bucket, {"step": step, "version": version - 1,
                                    "reward_mean": 0.125 * step, "reward_std": 0.25,
                                    "groups": 8, "kl": 0.0, "rewards/correct/mean": 0.1 * step})


def lora_weights(model):
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, save_embedding_layers=False)  # LoRA only, offline
    return {k: v.detach().clone() for k, v in state.items()}


def test_the_pushed_repository_loads_with_peft_and_its_card_names_the_run(hub, tiny_model,
                                                                          tmp_path):
    from huggingface_hub import ModelCard
    from peft import PeftModel
    from safetensors.torch import load as load_safetensors
    from transformers import AutoModelForCausalLM

    bucket, model = str(tmp_path / "bucket"), make_lora_model(tiny_model)
    publish(model, bucket, 1, 2, tiny_model)
    want = lora_weights(model)
    evals = []  # rollout.py --eval's result files, as jobs.sh --local writes them
    for adapter, version, accuracy in (("base", None, 0.125), ("latest", 1, 0.5)):
        evals.append(tmp_path / f"eval-{adapter}.json")
        evals[-1].write_text(json.dumps({"adapter": adapter, "version": version, "n": 8,
                                         "accuracy": accuracy, "results": []}))
    args = ("--bucket", bucket, "--dataset", "openai/gsm8k", "--reward-funcs",
            "rewards.py:correct", "fmt", "--reward-weights", "1.0", "0.5",
            "--eval", evals[0], "--eval", evals[1])  # one flag per file, as jobs.sh passes them
    r = push(hub, tmp_path, "me/tiny-grpo", *args, "--private", "--base-model", BASE_ID)
    assert r.returncode == 0, r.stderr
    assert re.search(rf"^pushed to {re.escape(hub.url)}/me/tiny-grpo/commit/[0-9a-f]{{40}}$",
                     r.stdout, re.M), r.stdout
    repo = hub.repos["me/tiny-grpo"]
    assert repo["private"] and repo["commits"] == ["GRPO adapter v000001 (step 2)"]
    assert set(repo["files"]) == {"adapter_config.json", "adapter_model.safetensors", "README.md"}

    # the weights: byte for byte the bucket's, and PEFT loads them onto the base model
    stored = buckets.DirBucket(bucket).read("adapters/v000001/adapter_model.safetensors")
    assert repo["files"]["adapter_model.safetensors"] == stored
    folder = hub.snapshot("me/tiny-grpo", str(tmp_path / "download"))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), folder)
    got, in_bucket = lora_weights(loaded), load_safetensors(stored)
    assert got.keys() == want.keys() == in_bucket.keys() and got
    for k in want:
        assert torch.equal(got[k], want[k]) and torch.equal(got[k], in_bucket[k]), k
    assert json.loads(repo["files"]["adapter_config.json"])["base_model_name_or_path"] == BASE_ID

    # the card: TRL's metadata for a PEFT adapter, and the run's base model, data, rewards, steps
    card = ModelCard.load(os.path.join(folder, "README.md"))
    assert card.data.base_model == BASE_ID and card.data.library_name == "peft"
    assert card.data.datasets == ["openai/gsm8k"]
    assert {"trl", "grpo", "lora", f"base_model:adapter:{BASE_ID}"} <= set(card.data.tags)
    text = card.text
    for named in (f"[{BASE_ID}](https://huggingface.co/{BASE_ID})", "`openai/gsm8k`",
                  "`rewards.py:correct` (weight 1), `fmt` (weight 0.5)",
                  "- Steps: 2 (adapter version v000001", "### Metrics at step 2",
                  "| reward_mean | 0.25 |", "| rewards/correct/mean | 0.2 |",
                  "| base | 8 | 0.125 | - |", "| latest (v1) | 8 | 0.5 | - |",
                  f'PeftModel.from_pretrained(base, "me/tiny-grpo")'):
        assert named in text, named

    # the next version onto the same repository (create_repo's 409 is "exists"); without
    # --base-model the card keeps the local folder out of its metadata, and says so on stderr
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.01)
    publish(model, bucket, 2, 4, tiny_model)
    r = push(hub, tmp_path, "me/tiny-grpo", "--bucket", bucket)
    assert r.returncode == 0, r.stderr
    assert "is a local folder" in r.stderr and "--base-model" in r.stderr
    assert repo["commits"][-1] == "GRPO adapter v000002 (step 4)" and repo["private"]
    folder = hub.snapshot("me/tiny-grpo", str(tmp_path / "download2"))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), folder)
    for k, v in lora_weights(loaded).items():
        assert torch.equal(v, lora_weights(model)[k]), k
    card = ModelCard.load(os.path.join(folder, "README.md"))
    assert card.data.base_model is None and "base_model" not in card.content.split("---")[1]
    assert f"`{tiny_model}` (a local folder)" in card.text and "### Metrics at step 4" in card.text
    assert not [rq for rq in hub.requests if rq[0] == "GET"], hub.requests  # nothing unserved


def test_an_empty_bucket_is_a_clear_error_and_nothing_is_sent(hub, tmp_path):
    r = push(hub, tmp_path, "me/x", "--bucket", tmp_path / "empty")
    assert r.returncode != 0
    assert "holds no adapter (no adapters/LATEST): nothing to push" in r.stderr, r.stderr
    assert hub.requests == [] and hub.repos == {}


def test_a_tampered_or_missing_version_is_refused_and_nothing_is_sent(hub, tiny_model, tmp_path):
    bucket = str(tmp_path / "bucket")
    publish(make_lora_model(tiny_model), bucket, 1, 1, tiny_model)
    path = os.path.join(bucket, "adapters", "v000001", "adapter_model.safetensors")
    with open(path, "r+b") as f:  # one byte changed after the manifest: same size, other sha256
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    r = push(hub, tmp_path, "me/x", "--bucket", bucket, "--timeout", 0)
    assert r.returncode != 0 and "adapter v000001 is corrupt" in r.stderr, r.stderr
    r = push(hub, tmp_path, "me/x", "--bucket", bucket, "--version", 7, "--timeout", 0)
    assert r.returncode != 0 and "adapter v000007 is not complete" in r.stderr, r.stderr
    assert hub.requests == [] and hub.repos == {}


def test_an_untagged_version_is_refused_under_the_adapter_key(hub, tiny_model, tmp_path):
    bucket = str(tmp_path / "bucket")
    publish(make_lora_model(tiny_model), bucket, 1, 1, tiny_model)  # published without the key
    r = push(hub, tmp_path, "me/x", "--bucket", bucket, ADAPTER_KEY="k")
    assert r.returncode != 0 and "without a valid tag under ADAPTER_KEY" in r.stderr, r.stderr
    assert hub.requests == []


def test_no_token_or_a_refused_one_is_a_clear_error(hub, tiny_model, tmp_path):
    bucket = str(tmp_path / "bucket")
    publish(make_lora_model(tiny_model), bucket, 1, 1, tiny_model)
    r = push(hub, tmp_path, "me/x", "--bucket", bucket, token=None)
    assert r.returncode != 0 and "no Hugging Face token: set HF_TOKEN" in r.stderr, r.stderr
    assert hub.requests == []
    r = push(hub, tmp_path, "me/x", "--bucket", bucket, token="hf_not_the_standins")
    assert r.returncode != 0 and "401" in r.stderr and "hf_not_the_standins" not in r.stderr
    # create_repo(exist_ok=True) takes a 401 as "may exist, no right to create": it asks for the
    # repository (GET /api/models/me/x, 404 here) and then raises the 401
    assert hub.requests == [("POST", "/api/repos/create"), ("GET", "/api/models/me/x")]
    assert hub.repos == {}


@pytest.mark.parametrize("xet", ["installed", "disabled"])
def test_the_requests_of_both_upload_paths_of_the_client(hub, tiny_model, tmp_path, xet):
    """upload_folder has the card checked (validate-yaml); then, with hf_xet installed, it runs
    its pipeline (_upload_pipeline.py), with HF_HUB_DISABLE_XET=1 create_commit, which checks the
    card once more. Either way: one create, one preupload, one commit, the bucket's bytes."""
    bucket = str(tmp_path / "bucket")
    publish(make_lora_model(tiny_model), bucket, 1, 1, tiny_model)
    env = {"HF_HUB_DISABLE_XET": "1"} if xet == "disabled" else {}
    r = push(hub, tmp_path, "tiny", "--bucket", bucket, "--base-model", BASE_ID, **env)
    assert r.returncode == 0, r.stderr
    check = [("POST", "/api/validate-yaml")] * (2 if xet == "disabled" else 1)
    assert hub.requests == [("POST", "/api/repos/create"), *check,
                            ("POST", "/api/models/standin-user/tiny/preupload/main"),
                            ("POST", "/api/models/standin-user/tiny/commit/main")]
    stored = buckets.DirBucket(bucket).read("adapters/v000001/adapter_model.safetensors")
    assert hub.repos["standin-user/tiny"]["files"]["adapter_model.safetensors"] == stored
    assert not hub.repos["standin-user/tiny"]["private"]  # no --private: the namespace's default


def test_bad_card_inputs_are_refused_before_anything_is_sent(hub, tiny_model, tmp_path):
    bucket = str(tmp_path / "bucket")
    publish(make_lora_model(tiny_model), bucket, 1, 1, tiny_model)
    r = push(hub, tmp_path, "me/x", "--bucket", bucket, "--reward-funcs", "a", "b",
             "--reward-weights", "1")
    assert r.returncode != 0 and "1 reward weights for 2 reward functions" in r.stderr, r.stderr
    (tmp_path / "eval.json").write_text("[1, 2]")
    r = push(hub, tmp_path, "me/x", "--bucket", bucket, "--eval", tmp_path / "eval.json")
    assert r.returncode != 0 and "not a rollout.py --eval result" in r.stderr, r.stderr
    r = push(hub, tmp_path, "me/x", "--bucket", bucket, "--eval", tmp_path / "missing.json")
    assert r.returncode != 0 and "missing.json" in r.stderr, r.stderr
    r = push(hub, tmp_path, "me/x/y", "--bucket", bucket)
    assert r.returncode != 0 and "'me/x/y' is not a Hub repository id" in r.stderr, r.stderr
    assert hub.requests == []


def test_the_card_lists_only_hub_ids_in_its_metadata(tiny_model):
    """TRL writes base_model only when the model was not a local folder; a local dataset file or
    a built-in task's name is no Hub dataset. The text names them all the same."""
    from huggingface_hub import ModelCard

    for base, dataset in ((tiny_model, "arith"), (tiny_model, "data/train.jsonl"),
                          ("org/model", "gsm8k")):
        card = ModelCard(hub_push.model_card("me/x", base, 3, {"step": 3}, None, dataset, ["f"]))
        assert card.data.datasets is None and f"`{dataset}`" in card.text
        assert card.data.base_model == (None if base == tiny_model else base)
        assert ("`" + base + "` (a local folder)" in card.text) == (base == tiny_model)
    card = ModelCard(hub_push.model_card("me/x", "org/model", 3, {}, None, "openai/gsm8k", []))
    assert card.data.datasets == ["openai/gsm8k"]
    assert "trained with GRPO on `openai/gsm8k`." in card.text


def test_odd_fields_in_the_bucket_do_not_stop_the_push(hub, tiny_model, tmp_path):
    """The manifest's own fields and the step records are whatever the bucket holds (only the
    files are checked against the manifest): a field that is not a time or a number, or a torn
    record, is left out of the card."""
    bucket = str(tmp_path / "bucket")
    publish(make_lora_model(tiny_model), bucket, 1, 2, tiny_model)
    path = os.path.join(bucket, "adapters", "v000001", "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(manifest, created="yesterday", step=[2]), f)
    with open(os.path.join(bucket, "metrics", "step-000002.json"), "w") as f:
        f.write('{"step": 2, "reward_')  # torn: the record before it is shown
    buckets.append_metrics(bucket, {"step": 1, "reward_mean": 0.5, "reward_std": "high"})
    r = push(hub, tmp_path, "me/x", "--bucket", bucket, "--base-model", BASE_ID)
    assert r.returncode == 0, r.stderr
    card = hub.repos["me/x"]["files"]["README.md"].decode()
    assert "- Steps: not recorded (adapter version v000001, published -)" in card
    assert "### Metrics at step 1" in card and "| reward_mean | 0.5 |" in card
    assert "reward_std" not in card
