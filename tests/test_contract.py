"""The run's contract (issue 12): proxy.py holds the settings every role must share; a replica and a
trainer started with none of them take the proxy's, one started with a different value is refused
with one clear line naming both values, and the run ends by itself when the trainer is done.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_contract.py -q

Real processes on 127.0.0.1: `proxy.py` (the CLI), `rollout.py --engine hf --task toy` and
`trainer.py` on the tiny model, a directory bucket.
"""

import json
import os
import subprocess
import sys

import sync
from support import buckets
from conftest import ROOT, free_port, wait_port

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PROXY_TOKEN": "t"}
SETTINGS = {"num_generations": 4, "groups_per_step": 2, "max_staleness": 1, "temperature": 0.7,
            "max_completion_length": 5, "zero_variance": "keep"}
# /config: defaults for the rest, and the length under its old name too
SERVED = {**SETTINGS, "max_prompt_length": 1024, "reward_range": [-1e6, 1e6], "max_new_tokens": 5}


def flags(settings):
    return [x for k, v in settings.items() for x in ("--" + k.replace("_", "-"), str(v))]


def error_line(r, prog):
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stdout[-1000:] + r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{prog}: error: "), r.stderr[-2000:]
    return line


def test_roles_take_the_proxys_settings_refuse_others_and_the_run_ends_by_itself(tiny_model, tmp_path):
    port, bucket = free_port(), str(tmp_path / "bucket")
    url = f"http://127.0.0.1:{port}"
    proxy = subprocess.Popen([sys.executable, "proxy.py", "--port", str(port), "--linger", "30", *flags(SETTINGS)],
                             cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    replica = None
    try:
        wait_port(port)
        rollout = [sys.executable, "rollout.py", "--engine", "hf", "--task", "toy", "--model", tiny_model,
                   "--bucket", bucket, "--proxy", url]
        trainer = [sys.executable, "trainer.py", "--model", tiny_model, "--bucket", bucket, "--proxy", url,
                   "--lora-r", "8", "--lora-alpha", "16", "--max-steps", "3"]
        # a flag that disagrees with the proxy: one line naming both values, before any model is loaded
        r = subprocess.run(rollout + ["--temperature", "1.0"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=120)
        line = error_line(r, "rollout.py")
        assert "--temperature 1.0 disagrees with the proxy's temperature 0.7" in line, line
        r = subprocess.run(trainer + ["--max-staleness", "3"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=120)
        line = error_line(r, "trainer.py")
        assert "--max-staleness 3 disagrees with the proxy's max_staleness 1" in line, line
        r = subprocess.run(trainer + ["--max-completion-length", "7"], cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=120)
        assert "--max-completion-length 7 disagrees with the proxy's max_completion_length 5" in error_line(
            r, "trainer.py")
        r = subprocess.run(rollout + ["--max-new-tokens", "7"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=120)  # the old name of the same flag
        assert "--max-completion-length 7 disagrees with the proxy's max_completion_length 5" in error_line(
            r, "rollout.py")
        assert sync.latest_version(bucket) is None, "nothing may be published by a refused trainer"

        # started with none of the settings, both take the proxy's; the same values given explicitly are fine
        with open(tmp_path / "replica.log", "w") as log:
            replica = subprocess.Popen(rollout + ["--num-generations", "4"], cwd=ROOT, env=ENV, stdout=log,
                                       stderr=subprocess.STDOUT)
        r = subprocess.run(trainer, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert f"run settings from the proxy: {SERVED}" in r.stdout
        assert replica.wait(timeout=60) == 0, "the replica exits 0 once the trainer is done"
        log = (tmp_path / "replica.log").read_text()
        assert f"run settings from the proxy: {SERVED}" in log and "the trainer is done" in log, log[-2000:]
        assert proxy.wait(timeout=60) == 0, "the proxy exits once the trainer is done and the replica was told"
        out = proxy.stdout.read()
        assert "every replica was told: exiting" in out, out[-2000:]
        recs = buckets.read_metrics(bucket)
        assert [m["step"] for m in recs] == [1, 2, 3] and all(m["groups"] == 2 for m in recs)
        assert max(m["staleness_max"] for m in recs) <= 1
        n = SETTINGS["groups_per_step"] * SETTINGS["num_generations"]  # truncated: ended without EOS
        assert all(0 <= m["truncated"] <= n and m["clipped_ratio"] == m["truncated"] / n for m in recs)
        stats = json.loads(out[out.index("stopped: ") + 9:].strip().replace("'", '"'))
        assert stats["accepted"] == stats["delivered"] + stats["dropped_stale"] + stats["buffered"]
    finally:
        for p in (replica, proxy):
            if p and p.poll() is None:
                p.kill()
                p.wait()
