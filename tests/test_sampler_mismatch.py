"""The sampler/learner mismatch over a run: scripts/report.py's summary lines (what
`jobs.sh --local` prints at the end), bench/bench_sampler_mismatch.py's tables, on hand-made
step records whose sums are worked out by hand, and the trainer's latest step line in
`jobs.sh status` (scripts/jobs_lib.sh's last_step, with a stand-in `hf`).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_sampler_mismatch.py
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_sampler_mismatch as bench  # noqa: E402
from scripts.report import mismatch_by_staleness, mismatch_lines  # noqa: E402
from support.buckets import DirBucket, append_metrics  # noqa: E402
from support.step_record import IS_RATIO, LOGP_DIFF  # noqa: E402


def by_k(tokens, mean, top, w_min, w_max, outside):
    return {"tokens": tokens, LOGP_DIFF + "mean": mean, LOGP_DIFF + "max": top,
            IS_RATIO + "min": w_min, IS_RATIO + "mean": 1.0, IS_RATIO + "max": w_max,
            IS_RATIO + "outside_frac": outside, "approx_kl": 0.0, "clip_frac": 0.0}


# three steps: k = 0 in steps 1 and 2, k = 1 in steps 2 and 3; step 3's k = 1 had no weight
STEPS = [{"step": 1, "reward_mean": 0.0,
          "by_staleness": {"0": by_k(10, 0.01, 0.05, 0.9, 1.1, 0.0)}},
         {"step": 2, "reward_mean": 0.5,
          "by_staleness": {"0": by_k(30, 0.03, 0.02, 0.8, 1.0, 0.5),
                           "1": by_k(20, 0.10, 0.70, 0.4, 2.5, 0.25)}},
         {"step": 3, "reward_mean": 1.0, "by_staleness": {"1": by_k(0, 0.0, 0.0, 0.0, 0.0, 0.0)}},
         {"step": 4, "reward_mean": 1.0}]  # a record from before by_staleness: passed over


def test_mismatch_by_staleness_sums_the_steps_by_hand():
    got = mismatch_by_staleness(STEPS)
    assert list(got) == [0, 1]
    assert got[0]["steps"] == 2 and got[0]["tokens"] == 40
    assert got[0]["dlogp_mean"] == pytest.approx((10 * 0.01 + 30 * 0.03) / 40)  # 0.025
    assert got[0]["dlogp_max"] == 0.05
    assert (got[0]["w_min"], got[0]["w_max"]) == (0.8, 1.1)
    assert got[0]["outside_frac"] == pytest.approx(30 * 0.5 / 40)
    # step 3's empty k = 1 counts as a step, but its 0.0 extremes are not weights
    assert got[1]["steps"] == 2 and got[1]["tokens"] == 20
    assert (got[1]["w_min"], got[1]["w_max"]) == (0.4, 2.5)
    assert got[1]["dlogp_mean"] == pytest.approx(0.10) and got[1]["outside_frac"] == 0.25
    assert mismatch_by_staleness([{"step": 1}]) == {} and mismatch_lines({}) == []


def test_report_prints_the_mismatch_by_staleness(tmp_path):
    """scripts/report.py on a run folder whose bucket holds STEPS: the lines under the table."""
    bucket = DirBucket(str(tmp_path / "bucket"))
    for m in STEPS:
        append_metrics(bucket, m)
    out = subprocess.run([sys.executable, "scripts/report.py", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("sampler/learner mismatch")))
    rows = [line.split() for line in lines[head + 4:head + 6]]
    assert rows == [["0", "2", "40", "2.50e-02", "5.00e-02", "0.800..1.100", "0.375"],
                    ["1", "2", "20", "1.00e-01", "7.00e-01", "0.400..2.500", "0.250"]], out.stdout



def test_report_shows_the_mean_reward_where_rewards_are_not_0_or_1(tmp_path):
    """A task whose rewards are not all 0 or 1 has no accuracy (support/evaluate.py writes
    mean_reward only): the table shows the mean reward there, not n/a; a 0/1 task its accuracy."""
    (tmp_path / "eval-base.json").write_text(json.dumps({"n": 40, "mean_reward": -0.3125}))
    (tmp_path / "eval-final.json").write_text(json.dumps(
        {"n": 40, "mean_reward": 0.75, "correct": 30, "accuracy": 0.75}))
    out = subprocess.run([sys.executable, "scripts/report.py", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in out.stdout.splitlines() if line.startswith("| greedy")}
    assert rows == {"greedy accuracy, base model": "mean reward -0.312 (40)",
                    "greedy accuracy, final adapter": "75.0% (30/40)"}, out.stdout

def record(mode, seed, late, staleness=2, dtype="bfloat16"):
    mm = {str(k): v for k, v in mismatch_by_staleness(STEPS).items()}
    return {"dtype": dtype, "staleness": staleness, "mode": mode, "seed": seed, "rc": 0,
            "name": f"x-{mode}-{seed}", "steps": 4, "wall_s": 1.0, "accuracy": None,
            "reward_last_third": late, "mismatch": mm}


def test_bench_pools_runs_and_tests_modes_against_sampler():
    runs = [record(m, s, late) for m, lates in (("sampler", [0.1, 0.2, 0.3]),
                                                ("token_truncate", [0.6, 0.7, 0.8]))
            for s, late in enumerate(lates)]
    two = bench.pooled([runs[0]["mismatch"], runs[1]["mismatch"]])
    one = mismatch_by_staleness(STEPS)
    assert two[0]["steps"] == 4 and two[0]["tokens"] == 80  # twice the one run
    assert two[0]["dlogp_mean"] == pytest.approx(one[0]["dlogp_mean"])
    assert (two[1]["w_min"], two[1]["w_max"]) == (0.4, 2.5)
    # 3 runs against 3, all higher: 1 split of the 20 is as extreme each way
    assert bench.two_sided([0.6, 0.7, 0.8], [0.1, 0.2, 0.3]) == pytest.approx(2 / 20)
    failed = dict(runs[0], seed=9, rc=1, steps=0, reward_last_third=float("nan"))
    text = bench.table(runs + [failed], "toy")  # a run without its outcome is left out
    rows = [line for line in text.splitlines() if line.startswith(("| bfloat16 | 2 |", "| 2 |"))]
    assert rows[0].startswith("| bfloat16 | 2 | `sampler` | 0,1,2 | 0.200 (0.100..0.300) | 1 "
                              "| - | 0 / 1 | 6 / 6 |")  # 3 runs of 2 steps at each k, 1 s each
    assert rows[1].startswith("| bfloat16 | 2 | `token_truncate` | 0,1,2 | 0.700 (0.600..0.800) |")
    assert rows[2] == ("| 2 | bfloat16 `token_truncate` | bfloat16 `sampler` | 0.700 vs 0.200 "
                       "| 0.10 | 3 / 0 | 0.250 |")
    assert bench.paired_p([0.5, 0.5, 0.5]) == 2 / 8  # all up, or all down
    assert bench.paired_p([0.1, -0.1]) == 1.0
    assert bench.paired_p([0.3, 0.1, -0.1]) == 6 / 8  # |sum| >= 0.3: +++, ++-, +-+ and mirrors


def test_bench_settings_and_table_only(tmp_path):
    assert bench.settings([0, 2], ["sampler", "sequence_mask"], True) == [
        ("bfloat16", 0, "sampler"), ("bfloat16", 0, "sequence_mask"),
        ("bfloat16", 2, "sampler"), ("bfloat16", 2, "sequence_mask"),
        ("float32", 0, "sampler"), ("float32", 2, "sampler")]
    # jobs.sh --local's own replica (float32) under every mode: no reference rows to add
    assert bench.settings([2], ["sampler", "token_truncate"], False, "float32") == [
        ("float32", 2, "sampler"), ("float32", 2, "token_truncate")]
    with open(tmp_path / "runs.jsonl", "w") as f:
        for s, acc in enumerate([0.5, 0.6]):  # seed 1's jobs.sh failed after its summary
            f.write(json.dumps(dict(record("sampler", s, 0.0), accuracy=acc, rc=127 * s)) + "\n")
        f.write(json.dumps(dict(record("sampler", 2, 0.0), rc=1, steps=3)) + "\n")  # no eval
    out = subprocess.run([sys.executable, "bench/bench_sampler_mismatch.py", "--task", "arith",
                          "--out", str(tmp_path), "--table-only"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "final greedy accuracy" in out.stdout
    assert "| bfloat16 | 2 | `sampler` | 0,1 | 0.550 (0.500..0.600) |" in out.stdout


def test_jobs_status_shows_the_trainers_latest_step(tmp_path):
    """scripts/jobs_lib.sh's last_step (part of `bash jobs.sh status`): the trainer job's last
    step line from `hf jobs logs --tail 50 ID`, with its |dlogp| and is_out; a line saying so
    when no step is logged yet."""
    (tmp_path / "jobs.txt").write_text("proxy aaa\ntrainer bbb\n")
    hf = tmp_path / "hf"
    hf.write_text('#!/usr/bin/env bash\necho "$*" >> "$HF_LOG"\ncat "$HF_LINES"\n')
    hf.chmod(0o755)
    lines = tmp_path / "lines"
    lines.write_text("step 7 v6 | reward 0.5 | sampler |dlogp| 0.0161 is_out 0.000 | gnorm 1\n"
                     "published v7 at step 7\n"
                     "2026-12-03T19:00:00Z step 8 v7 | reward 0.6 | sampler |dlogp| 0.0170 "
                     "is_out 0.125 | gnorm 1\nsaved state at step 8 (version 7)\n")
    script = f'. scripts/jobs_lib.sh; RUN={tmp_path}; HF=("{hf}"); last_step'
    env = dict(os.environ, HF_LOG=str(tmp_path / "calls"), HF_LINES=str(lines))
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == ("  step 8 v7 | reward 0.6 | sampler |dlogp| 0.0170 "
                                           "is_out 0.125 | gnorm 1")
    assert (tmp_path / "calls").read_text() == "jobs logs --tail 50 bbb\n"
    lines.write_text("starting fresh\n")
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.splitlines()[-1] == "  none logged yet"
