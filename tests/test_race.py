"""The race's arithmetic (bench/race_stats.py, used by bench/bench_vs_trl.py): time to a target from
checkpoint lists, the bootstrap interval over seeds, McNemar's paired test, and the CPU accounting
of the contention sampler. tests/data/race_small.json holds the runs of a real two-seed race of
bench_vs_trl.py at a tiny scale (2 steps a side, 20 held-out problems), as it wrote them.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_race.py
"""

import json
import math
import os
import statistics
import subprocess
import sys
import time

import pytest

import race_stats as rs
from conftest import ROOT

HERE = os.path.dirname(os.path.abspath(__file__))


def checkpoints(*points):
    return [{"step": s, "t": t, "accuracy": acc} for s, t, acc in points]


def test_time_to_target_is_the_first_checkpoint_at_or_above_it():
    cps = checkpoints((2, 20.0, 0.50), (4, 40.0, 0.81), (6, 60.0, 0.78), (8, 80.0, 0.90))
    assert rs.time_to_target(cps, 0.8) == (40.0, 4)
    assert rs.time_to_target(cps, 0.81) == (40.0, 4)  # at, not only above
    assert rs.time_to_target(cps, 0.85) == (80.0, 8)
    assert rs.time_to_target(cps, 0.95) is None


def test_accuracy_at_a_time_is_the_last_checkpoint_before_it():
    cps = checkpoints((2, 20.0, 0.50), (4, 40.0, 0.81))
    assert rs.accuracy_at(cps, 10.0, base_accuracy=0.13) == 0.13  # before the first: the base model
    assert rs.accuracy_at(cps, 20.0, 0.13) == 0.50
    assert rs.accuracy_at(cps, 39.9, 0.13) == 0.50
    assert rs.accuracy_at(cps, 1e6, 0.13) == 0.81


def test_time_ratio_bounds_a_side_that_never_reached_the_target():
    assert rs.time_ratio(50.0, 250.0, 900.0) == (0.2, "")
    assert rs.time_ratio(50.0, None, 1000.0) == (0.05, "<")  # TRL would need more than its whole run
    assert rs.time_ratio(None, 250.0, 900.0) == (math.inf, ">")
    assert rs.median([0.2, math.inf, 0.3]) == 0.3  # a side that never got there is the largest ratio


def test_mcnemar_exact_p_values_by_hand():
    assert rs.mcnemar_counts(0, 5)["p"] == pytest.approx(2 / 32)  # 2 x 0.5^5
    assert rs.mcnemar_counts(2, 8)["p"] == pytest.approx(2 * (1 + 10 + 45) / 1024)
    assert rs.mcnemar_counts(4, 4)["p"] == 1.0
    assert rs.mcnemar_counts(0, 0)["p"] == 1.0  # no discordant problem: no evidence either way
    assert rs.mcnemar("1100", "1011") == {"only_a": 1, "only_b": 2, "p": 1.0}
    with pytest.raises(ValueError, match="same held-out problems"):
        rs.mcnemar("110", "1011")


def test_bootstrap_interval_of_the_median():
    assert rs.bootstrap_median([0.25, 0.25, 0.25]) == (0.25, 0.25, 0.25)
    # 3 values: all three draws equal the smallest with probability 1/27 > 2.5%, so the 95%
    # interval reaches the smallest and the largest value
    assert rs.bootstrap_median([0.1, 0.2, 0.3]) == (0.2, 0.1, 0.3)
    med, lo, hi = rs.bootstrap_median([0.1, 0.12, 0.15, 0.2, 0.4])
    assert med == 0.15 and 0.1 <= lo < med < hi <= 0.4
    assert rs.bootstrap_median([0.1, 0.2, math.inf]) == (0.2, 0.1, math.inf)


def test_bootstrap_interval_of_a_difference_resamples_each_side_on_its_own():
    assert rs.bootstrap_difference([0.7, 0.7], [0.6, 0.6]) == pytest.approx((0.1, 0.1, 0.1))
    # one side constant: the interval is the other side's bootstrap interval of its mean,
    # mirrored; 2 values: both draws equal the smaller with probability 1/4 > 5%
    d, lo, hi = rs.bootstrap_difference([0.7], [0.5, 0.7])
    assert (d, lo, hi) == pytest.approx((0.1, 0.0, 0.2))
    d, lo, hi = rs.bootstrap_difference([0.70, 0.65, 0.74, 0.62, 0.72],
                                        [0.65, 0.67, 0.58, 0.50, 0.74], statistics.median)
    assert d == pytest.approx(0.70 - 0.65) and lo < 0 < d < hi


def test_the_many_seed_table_reads_both_record_kinds(tmp_path):
    """race_seeds.py table: race_seeds' own records (one or a list a file) and
    bench_sampler_mismatch's runs.jsonl (the side: the file's name; failed runs left out)."""
    import race_seeds

    (tmp_path / "old.json").write_text(json.dumps(
        [{"side": "trl", "seed": 0, "accuracy": 0.7}, {"side": "trl", "seed": 1, "accuracy": 0.6}]))
    (tmp_path / "trl-seed2.json").write_text(json.dumps({"side": "trl", "seed": 2,
                                                         "accuracy": 0.8}))
    (tmp_path / "ours-defaults.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"seed": 0, "rc": 0, "accuracy": 0.5}, {"seed": 1, "rc": 1, "accuracy": None},
        {"seed": 2, "rc": 0, "accuracy": 0.65}]))
    records = race_seeds.load_records([str(tmp_path)])
    assert records == {"trl": {0: 0.7, 1: 0.6, 2: 0.8}, "ours-defaults": {0: 0.5, 2: 0.65}}
    text = race_seeds.table(records)
    assert "| 70.0 | 60.0 | 80.0 | 3     | 70.0   | 70.0 |" in text
    assert "| 50.0 | -    | 65.0 | 2     | 57.5   | 57.5 |" in text
    assert "+12.5 [" in text and "| 3 / 2 " in text


def test_compare_and_over_seeds_on_a_real_race():
    with open(os.path.join(HERE, "data", "race_small.json")) as f:
        race = json.load(f)
    rows = []
    for seed, runs in race["runs"].items():
        trl, ours = runs["trl"], runs["ours"]
        n = len(trl["checkpoints"][-1]["correct"])
        assert n == race["held_out_problems"] and all(len(c["correct"]) == n for r in (trl, ours)
                                                      for c in r["checkpoints"])
        for r in (trl, ours):  # each accuracy is its problems' mean
            assert all(c["accuracy"] == pytest.approx(c["correct"].count("1") / n) for c in r["checkpoints"])
        target = max(c["accuracy"] for c in ours["checkpoints"])  # reached by ours, at its best checkpoint
        row = rs.compare(trl, ours, target)
        best = next(c for c in ours["checkpoints"] if c["accuracy"] >= target)
        assert (row["ours_time_to_target"], row["ours_step_to_target"]) == (best["t"], best["step"])
        assert row["ours_final"] == ours["checkpoints"][-1]["accuracy"]
        pairs = list(zip(trl["checkpoints"][-1]["correct"], ours["checkpoints"][-1]["correct"]))
        assert row["paired_final"]["only_a"] == pairs.count(("1", "0"))
        assert row["paired_final"]["only_b"] == pairs.count(("0", "1"))
        if row["trl_time_to_target"] is None:
            assert row["ratio_qualifier"] == "<" and row["ratio"] == best["t"] / trl["train_s"]
        else:
            assert row["ratio"] == best["t"] / row["trl_time_to_target"]
        rows.append(row)
    verdict = rs.over_seeds(rows)
    assert verdict["seeds"] == len(rows) == 2
    assert verdict["median_ours_final"] == pytest.approx(sum(r["ours_final"] for r in rows) / 2)
    lo, hi = verdict["ratio_interval"]
    assert min(r["ratio"] for r in rows) == lo <= verdict["median_ratio"] <= hi == max(r["ratio"] for r in rows)
    pooled = verdict["pooled_paired_final"]
    assert pooled["only_a"] == sum(r["paired_final"]["only_a"] for r in rows)


def test_tree_cpu_ticks_counts_live_and_reaped_children():
    """The contention sampler subtracts this process tree's CPU from the machine's: a child's CPU
    time must count while it runs and after it exited (its parent's cutime)."""
    hz, me = os.sysconf("SC_CLK_TCK"), os.getpid()
    burn = "import time\nwhile time.process_time() < 0.6: pass\nimport sys; sys.stdout.write('x'); sys.stdout.flush()" \
           "\nsys.stdin.read()"
    before = rs.tree_cpu_ticks(me)
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout.read(1) == b"x"  # it has used 0.6 s of CPU and still runs
    alive = rs.tree_cpu_ticks(me)
    child.stdin.close()
    child.wait()
    reaped = rs.tree_cpu_ticks(me)
    assert alive - before >= 0.5 * hz
    assert reaped - before >= 0.5 * hz


def test_contention_sampler_summary_window():
    sampler = rs.ContentionSampler(interval=0.2)
    sampler.start()
    t0 = time.time()
    time.sleep(1.1)
    sampler.stop()
    whole = sampler.summary()
    assert whole["samples"] >= 3 and 0 <= whole["mean"] <= whole["max"] <= (os.cpu_count() or 1) + 0.5
    assert sampler.summary(t0 + 100, t0 + 200) == {"mean": None, "max": None, "samples": 0}


def test_ours_settings_other_than_jobs_defaults_are_checked_by_name():
    import bench_vs_trl

    assert bench_vs_trl.parse_args(["--ours", "MAX_STALENESS=0"]).ours == {"MAX_STALENESS": "0"}
    assert bench_vs_trl.parse_args(["--ours", "MAX_STALENESS=0", "--ours", "THREADS=2"]).ours == {
        "MAX_STALENESS": "0", "THREADS": "2"}
    assert bench_vs_trl.parse_args([]).ours == {}
    for bad in ("LEARNING_RATE=1e-3", "MAX_STALENESS", "MAX_STALENESS="):  # a shared setting: both
        with pytest.raises(SystemExit):
            bench_vs_trl.parse_args(["--ours", bad])


def test_the_races_settings_are_jobs_sh_local_defaults():
    """bench_vs_trl.jobs_defaults (the race, the seeds and the swap read it) evaluates jobs.sh's
    settings block as `jobs.sh --local` does: the table's local values, jobs.sh's THREADS."""
    import bench_vs_trl
    from support import defaults

    got, local = bench_vs_trl.jobs_defaults(), defaults.values("local")
    for name in ("TASK", "GROUPS_PER_STEP", "NUM_GENERATIONS", "LEARNING_RATE", "LORA_R", "SEED",
                 "MAX_STALENESS", "STEPS"):
        assert got[name] == local[name], name
    assert got["MAX_NEW_TOKENS"] == local["MAX_COMPLETION_LENGTH"]
    assert got["THREADS"] == "1"


def test_the_paired_sign_flip_test_by_hand():
    """race_stats.sign_flip_test: of the 8 sign patterns of (1, 2, 3) only all + and all - reach
    |sum| 6; differences that cancel are as far as every pattern; a wrong sign counts less."""
    assert rs.sign_flip_test([0.01, 0.02, 0.03]) == 2 / 8
    assert rs.sign_flip_test([0.01, -0.01]) == 1.0
    assert rs.sign_flip_test([0.03, 0.02, -0.01]) == 4 / 8  # |sum| >= 4: +++, ++-, and negatives


def test_the_rank_test_over_runs_counts_every_split_of_the_pooled_runs():
    # TRL's runs rank 2nd, 5th and 6th of six: splits with a rank sum >= 13 are
    # {4,5,6}, {3,5,6}, {2,5,6}, {3,4,6}: 4 of 20
    assert rs.rank_test([0.647, 0.703, 0.742], [0.611, 0.652, 0.664]) == 4 / 20
    assert rs.rank_test([0.9, 0.8, 0.7], [0.1, 0.2, 0.3]) == 1 / 20  # all above: the smallest p
    assert rs.rank_test([0.1, 0.2], [0.8, 0.9]) == 1.0
    assert rs.rank_test([0.5, 0.5], [0.5, 0.5]) == 1.0  # all tied: no evidence either way


def test_what_each_side_trained_on_comes_from_each_sides_own_records(tmp_path):
    """batch_table: TRL's steps from the log_history of its last checkpoint (not an earlier one),
    ours from the bucket's metrics/step-N.json, in the fields each writes; the mean over seeds and
    over each third of the steps."""
    import bench_vs_trl

    runs = {}
    for seed in (0, 1):
        work = tmp_path / f"seed-{seed}" / "trl"
        for last, step_offset in ((2, 9), (3, 0)):  # checkpoint-2 holds other numbers: not read
            (work / f"checkpoint-{last}").mkdir(parents=True)
            log = [{"step": s, "reward": 0.1 * s + seed + step_offset, "frac_reward_zero_std": 0.25,
                    "completions/mean_length": 11.0, "completions/clipped_ratio": 0.5,
                    "grad_norm": 2.0 * s} for s in range(1, last + 1)]
            log.append({"train_runtime": 1.0, "step": last})  # the end-of-run record: no reward
            (work / f"checkpoint-{last}" / "trainer_state.json").write_text(
                json.dumps({"log_history": log}))
        runs[(seed, "trl")] = {"bucket": str(work / "checkpoints")}
        metrics = tmp_path / f"ours-{seed}" / "bucket" / "metrics"
        metrics.mkdir(parents=True)
        for s in (1, 2, 3):
            (metrics / f"step-{s:06d}.json").write_text(json.dumps(
                {"step": s, "reward_mean": 0.2 * s + seed, "groups": 4, "groups_zero_variance": s,
                 "tokens": 4 * 8 * 10, "clipped_ratio": 0.75, "grad_norm": 1.0}))
        runs[(seed, "ours")] = {"run_dir": str(tmp_path / f"ours-{seed}")}
    table = bench_vs_trl.batch_table(runs, steps=3, G=8).splitlines()
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in table[2:]}
    assert table[0].split("|")[2].strip() == "steps 1-1"
    assert cells["mean reward, TRL"] == ["0.60", "0.70", "0.80"]  # 0.1 s + mean of seeds 0, 1
    assert cells["mean reward, ours"] == ["0.70", "0.90", "1.10"]
    assert cells["groups with all-equal rewards, ours"] == ["0.25", "0.50", "0.75"]
    assert cells["groups with all-equal rewards, TRL"] == ["0.25"] * 3
    assert cells["mean completion tokens, ours"] == ["10.00"] * 3
    assert cells["completions ended without EOS, TRL"] == ["0.50"] * 3
    assert cells["gradient norm before clipping, TRL"] == ["2.00", "4.00", "6.00"]


def test_the_allocator_setting_keeps_freed_blocks_in_the_process():
    """MALLOC_KEPT (jobs.sh's for our trainer, probed for TRL): a freed 64 MB block is reused,
    not unmapped and faulted in again; with glibc's defaults each of 3 more rounds faults it in."""
    import bench_vs_trl

    code = ("import resource\nfor i in range(4):\n    b = bytearray(64 << 20)\n    del b\n"
            "    if i == 0:\n        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)")
    faults = {name: int(subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **extra),
                                       capture_output=True, text=True, check=True).stdout)
              for name, extra in (("glibc", {}), ("kept", bench_vs_trl.MALLOC_KEPT))}
    pages = 3 * (64 << 20) // 4096
    assert faults["kept"] < 0.05 * pages and faults["glibc"] > 0.5 * pages, faults
    with open(os.path.join(ROOT, "jobs.sh")) as f:  # the same values where jobs.sh starts the trainer
        assert " ".join(f"{k}={v}" for k, v in bench_vs_trl.MALLOC_KEPT.items()) in f.read()


def test_race_floor_prices_the_batches_and_steps_before_the_target(tmp_path):
    """bench/race_floor.py: the batches a replica logged with an adapter older than the target
    step (rollout.py's own batch line), each at bench_generate's floor, and each trainer step
    before it as twice its forward, counted here by hand."""
    from types import SimpleNamespace

    import race_floor
    import rollout
    from support import buckets
    from bench_generate import work

    lines, R = [], 2e9  # every matmul at R FLOP/s
    replica = SimpleNamespace(batches=0, version=0, trainer_version=0, reload_s=0.0,
                              log=lines.append)
    for version, n in ((0, 3), (1, 2), (2, 5)):  # a target at step 2: versions 0 and 1 count
        replica.batches, replica.version = replica.batches + 1, version
        groups = [{"group_id": f"g{version}-{k}", "completions": [
            {"reward": 1.0, "ids": [5, 6]}, {"reward": 0.0, "ids": [7]}]} for k in range(n)]
        rollout.Replica.log_batch(replica, groups, {"accepted": n, "stale": 0}, 0.5)
    (tmp_path / "rollout-0.log").write_text("".join(f"[replica-0] {x}\n" for x in lines))
    bucket = str(tmp_path / "bucket")
    for step, tokens in ((1, 7), (2, 9), (3, 100)):
        buckets.append_metrics(bucket, {"step": step, "groups": 2, "tokens": tokens})
    config = SimpleNamespace(hidden_size=8, intermediate_size=16, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=4, num_hidden_layers=3,
                             vocab_size=32)
    maps = [(8, 8), (8, 4), (8, 4), (8, 8), (8, 16), (8, 16), (16, 8)]
    best = {io: R for io in set(maps) | {(8, 32)}}
    prompt_lens, prefix, G, T = [6, 7], 4, 2, 3
    made, gen, train = race_floor.seed_floor(str(tmp_path), buckets.read_metrics(bucket), 2,
                                             prompt_lens, prefix, config, best, G, T)
    assert made == 5
    expected_gen = 0.0
    for n in (3, 2):
        mm, attn = work(config, [prompt_lens[k % 2] for k in range(n)], prefix, n * G, T)
        expected_gen += (sum(2 * r * i * o * c for (r, i, o), c in mm.items()) + attn) / R
    assert gen == pytest.approx(expected_gen)
    per_row = 2 * 3 * sum(i * o for i, o in maps)  # every layer's maps, one token
    rows = [4 + 2 + 3 + tokens for tokens in (7, 9)]  # the prefix, each prompt's rest, completions
    assert train == pytest.approx(sum(2 * (r * per_row + 2 * t * 8 * 32) / R
                                      for r, t in zip(rows, (7, 9))))


def test_race_floor_solves_for_the_fraction_of_the_floor_a_median_ratio_needs():
    import race_floor

    rows = [(10.0, 10.0, 100.0), (10.0, 10.0, 100.0), (40.0, 0.0, 100.0)]  # (floor, start, TRL)
    # the median seed at 10 / e / 100 <= 0.2: e >= 0.5; with its 10 s start-up, e >= 1
    assert race_floor.needed(rows, 0.2, False) == "0.50"
    assert race_floor.needed(rows, 0.2, True) == "1.00"
    assert race_floor.needed(rows, 0.05, False).startswith("> 1 (median 0.100x")
