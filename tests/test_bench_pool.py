"""bench/bench_pool.py's measurements against hand-computed numbers (the benchmark itself takes
minutes: run it as its docstring says).

    .venv/bin/python -m pytest tests/test_bench_pool.py -q
"""

import os
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_pool  # noqa: E402


def test_stall_per_kill_is_the_time_beyond_the_fast_replica_alone_until_the_killed_one_is_back():
    # steps end every 0.5 s; a kill at 10.2 holds the trainer 0.8 s (the step ending 11.3, not
    # 10.5); replica 1 is back at 11.6; a second kill at 12.1 costs nothing (back at 12.4)
    ends = [9.5, 10.0, 11.3, 11.8, 12.3, 12.8]
    run = {"metrics": [{"step": i, "time": t} for i, t in enumerate(ends)],
           "batches": [{"t": t, "replica": "replica-1"} for t in (9.9, 11.6, 12.4)]
           + [{"t": 12.0, "replica": "replica-0"}]}
    # kill 1: from 10.0 (last end before) to 11.8 (first end after 11.6): 2 steps, 1.8 - 1.0
    # kill 2: from 11.8 to 12.8 (first end after 12.4): 2 steps, 1.0 - 1.0
    got = bench_pool.stalls(run, [10.2, 12.1], step_alone=0.5)
    assert [round(x, 6) for x in got] == [0.8, 0.0]
    assert bench_pool.stalls(run, [12.9], step_alone=0.5) == []  # never back in the run: not counted


def test_seconds_per_token_reads_the_replicas_batch_lines_in_the_window(tmp_path):
    log = tmp_path / "replica-0.log"
    line = ("{t} [replica-0] batch {i} v0 (trainer v0) 8 groups 10.00 groups/s {tps} tokens/s reward "
            "0.5 reload 0.00s accepted 8 stale 0 gen {gen}s\n")
    log.write_text(line.format(t=1.0, i=1, tps=1000, gen=0.5)  # before the window
                   + line.format(t=2.0, i=2, tps=2000, gen=1.0)  # 2000 tokens in 1 s
                   + "2.5 [replica-0] adapter v1 loaded (pull 0.010s, load 0.020s)\n"
                   + line.format(t=3.0, i=3, tps=1000, gen=3.0))  # 3000 tokens in 3 s
    assert bench_pool.seconds_per_token(str(log), 1.5, 3.0) == 4.0 / 5000


def test_paces_counts_each_generate_call_of_a_replica_and_its_restarts_in_the_window(tmp_path):
    pace = "{t} [pace] real {real}s emulated {emulated}s\n"
    (tmp_path / "replica-1.log").write_text(
        pace.format(t=1.0, real=0.1, emulated=0.5)  # before the window
        + pace.format(t=2.0, real=0.2, emulated=0.5)  # kept
        + pace.format(t=2.5, real=0.7, emulated=0.5))  # its real work outran its emulated time
    (tmp_path / "replica-1.1.log").write_text(pace.format(t=3.0, real=0.4, emulated=0.4))
    (tmp_path / "replica-0.log").write_text(pace.format(t=2.0, real=0.9, emulated=0.5))
    assert bench_pool.paces(str(tmp_path), "replica-1", 1.5, 3.0) == (2, 3)
    assert bench_pool.paces(str(tmp_path), "replica-0", 1.5, 3.0) == (0, 1)


def test_the_bound_is_the_trainer_or_the_pools_combined_rate_whichever_is_slower():
    def run(step_s, rate0=None, rate1=None, t_train=0.5):
        per = {"replica-0": {"rate": rate0 or 10.0}}
        if rate1:
            per["replica-1"] = {"rate": rate1}
        return {"step_s": step_s, "T_train": t_train, "per": per}

    # B = 8 groups; the fast one makes 10 groups/s alone: 0.8 s a step, the trainer 0.5 s
    runs = [run(0.8), run(0.6, rate1=5.0), run(0.55, rate1=10.0)]
    bench_pool.derive(runs, groups=8)
    assert [round(r["bound"], 3) for r in runs] == [0.8, 0.533, 0.5]  # 8/10, 8/15, T_train
    assert [round(r["vs_alone"], 3) for r in runs] == [1.0, 1.333, 1.455]
    assert [round(r["of_bound"], 3) for r in runs] == [1.0, 0.889, 0.909]
    assert [r["k_as_run"] for r in runs] == [None, 2.0, 1.0]
