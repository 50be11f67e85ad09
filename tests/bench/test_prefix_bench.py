"""bench.prefix_bench's pure parts: the request bodies of its workloads and the summary's ratios."""

from __future__ import annotations

import argparse

from bench.prefix_bench import completion_jobs, summarise


def args(**kw) -> argparse.Namespace:
    values = {"seed": 0, "prefix_words": 40, "question_words": 6, "per_task": 3, "out": 16}
    return argparse.Namespace(**{**values, **kw})


def test_shared_jobs_repeat_each_tasks_prefix_and_unique_ones_never_do():
    shared = completion_jobs(args(), ["a", "b"], shared=True)
    unique = completion_jobs(args(), ["a", "b"], shared=False)
    assert len(shared) == len(unique) == 6 and [j["model"] for j in shared[:4]] == ["a", "b", "a", "b"]
    prefix = [j["prompt"].split("\nInput:")[0] for j in shared]
    assert prefix[0] == prefix[2] == prefix[4] and prefix[0] != prefix[1]
    assert len({j["prompt"].split("\nInput:")[0] for j in unique}) == 6
    assert all(j["ignore_eos"] and j["min_tokens"] == j["max_tokens"] == 16 for j in shared)


def test_the_summary_takes_medians_over_rounds():
    def row(total, ttft):
        return {"total_s": total, "ttft_p50_s": ttft}

    got = summarise({"polyserve": {"shared": [row(10, 0.2), row(30, 0.3), row(12, 0.1)], "unique": [row(48, 5)]},
                     "vllm": {"shared": [row(36, 1.0), row(30, 2.0), row(40, 1.5)]}})
    assert got == {"polyserve_unique_over_shared": 4.0, "shared_speed_ratio": 3.0, "shared_ttft_p50_ratio": 0.13}
