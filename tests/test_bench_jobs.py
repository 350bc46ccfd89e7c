"""bench/adaptation.py's job queue, with real processes: at most two at a time, an evaluation only after its model's
training, and a failure skips its dependants but not the others."""

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from adaptation import Job, run_jobs  # noqa: E402

# Each job records when it ran, in its own file next to its log.
RECORD = ("import json, sys, time; start = time.time(); time.sleep(float(sys.argv[2])); "
          "json.dump([start, time.time()], open(sys.argv[1], 'w')); sys.exit(int(sys.argv[3]))")


def job(tmp_path, name, seconds, after=None, code=0):
    return Job([sys.executable, "-c", RECORD, str(tmp_path / f"{name}.json"), str(seconds), str(code)],
               tmp_path / f"{name}.log", after=None if after is None else tmp_path / f"{after}.log")


def spans(tmp_path, names):
    return {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in names}


def test_two_at_a_time_and_evaluations_follow_their_own_training(tmp_path):
    jobs = [job(tmp_path, "train-fast", 0.2), job(tmp_path, "train-slow", 4.0),
            job(tmp_path, "eval-slow", 0.2, after="train-slow"), job(tmp_path, "eval-fast", 0.2, after="train-fast"),
            job(tmp_path, "independent", 0.5)]
    started = time.time()
    run_jobs(jobs, poll_seconds=0.05)
    ran = spans(tmp_path, ["train-fast", "train-slow", "eval-slow", "eval-fast", "independent"])
    assert ran["eval-fast"][0] >= ran["train-fast"][1] and ran["eval-slow"][0] >= ran["train-slow"][1]
    # the fast model's evaluation did not wait for the slow training (the old bench waited for every training)
    assert ran["eval-fast"][1] < ran["train-slow"][1]
    events = sorted([(s, 1) for s, _ in ran.values()] + [(e, -1) for _, e in ran.values()], key=lambda x: (x[0], x[1]))
    running = [sum(step for _, step in events[:i + 1]) for i in range(len(events))]
    assert max(running) == 2  # never three, though three jobs were ready once the fast training ended
    assert time.time() - started < 20


def test_a_failure_skips_its_dependants_and_says_so(tmp_path):
    jobs = [job(tmp_path, "train-bad", 0.1, code=3), job(tmp_path, "train-good", 0.3),
            job(tmp_path, "eval-bad", 0.1, after="train-bad"), job(tmp_path, "eval-good", 0.1, after="train-good")]
    with pytest.raises(SystemExit) as failure:
        run_jobs(jobs, poll_seconds=0.05)
    message = str(failure.value)
    assert "train-bad" in message and "not run" in message and "eval-bad.log" in message
    assert (tmp_path / "eval-good.json").exists() and not (tmp_path / "eval-bad.json").exists()


def test_a_killed_job_is_named_with_its_signal_and_the_likely_fix(tmp_path):
    """The kernel's out-of-memory killer ends a training with SIGKILL and its log just stops: the message says so."""
    killed = Job([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                 tmp_path / "train-killed.log")
    with pytest.raises(SystemExit) as failure:
        run_jobs([killed, job(tmp_path, "train-failed", 0.1, code=3)], poll_seconds=0.05)
    message = str(failure.value)
    assert "killed by SIGKILL" in message and "out-of-memory" in message and "--jobs 1" in message
    assert "(exit status 3)" in message


def test_one_slot_runs_one_job_at_a_time(tmp_path):
    jobs = [job(tmp_path, name, 0.3) for name in ("first", "second", "third")]
    run_jobs(jobs, slots=1, poll_seconds=0.05)
    ran = sorted(spans(tmp_path, ["first", "second", "third"]).values())
    assert all(later[0] >= earlier[1] for earlier, later in zip(ran, ran[1:]))
