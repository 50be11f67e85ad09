"""lm-evaluation-harness (`lm-eval`, pinned in the test extra) against a live server on the default
backbone with the shipped inventory, offline: a local YAML task over a JSONL file this test writes,
the tokenizer from the backbone's local directory, `--batch_size 8` (so the harness sends lists of
token-id prompts), for a shipped task and for `base`:

    multiple choice (loglikelihood: max_tokens 1 + echo + logprobs)   acc
    generate_until (greedy, the same token budget as `polyserve eval`) exact_match

The harness's numbers must equal polyserve's own: `polyserve eval` (exact match) for the task,
training.evaluate.evaluate_task for `base` (what `eval` runs, with no adapter), and the
multiple-choice accuracy of plain forwards of the same adapter (or none)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.server_fixtures import live_server, settings_for, shipped_inventory_available

pytestmark = pytest.mark.slow

N = 8  # examples: one batch of the harness
ROOT = Path(__file__).resolve().parents[3]

GEN_YAML = """task: polyserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Input: {{{{input}}}}\\nOutput:"
doc_to_target: "{{{{output}}}}"
generation_kwargs:
  until: [{eos}]
  max_gen_toks: {max_tokens}
  do_sample: false
filter_list:
  - name: strip
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
"""

MC_YAML = """task: polyserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Input: {{{{input}}}}\\nOutput:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""


def harness(tmp_path: Path, url: str, model: str, tokenizer_dir: Path) -> dict:
    out = tmp_path / f"out-{model}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"), "HF_HOME": str(tmp_path / "hf-home"),
           "TOKENIZERS_PARALLELISM": "false"}
    model_args = (f"base_url={url}/v1/completions,model={model},tokenizer={tokenizer_dir},"
                  "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1,"
                  "max_length=1024")
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
           "--tasks", "polyserve_mc,polyserve_gen", "--include_path", str(tmp_path / "tasks"),
           "--batch_size", "8", "--output_path", str(out)]
    run = subprocess.run(cmd, check=False, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    results = sorted(out.rglob("results_*.json"))
    assert results, run.stderr[-3000:]
    return json.loads(results[-1].read_text())["results"]


def choice_acc(rm, adapter, tok, docs: list[dict]) -> float:
    """Multiple-choice accuracy from plain forwards: each choice's summed logprob after the
    prompt (the harness's split of context and continuation tokens), argmax against the label."""
    from training.evaluate import set_plan

    right = 0
    for doc in docs:
        context = f"Input: {doc['input']}\nOutput:"
        ctx = tok(context).input_ids
        scores = []
        for choice in doc["choices"]:
            whole = tok(context + " " + choice).input_ids
            set_plan(rm, adapter, 1)
            with torch.inference_mode():
                lp = torch.log_softmax(rm.model(torch.tensor([whole])).logits[0].float(), dim=-1)
            scores.append(sum(float(lp[i - 1, whole[i]]) for i in range(len(ctx), len(whole))))
        right += int(max(range(len(scores)), key=scores.__getitem__) == doc["label"])
    return right / len(docs)


def test_lm_eval_harness_matches_polyserve_eval(tmp_path):
    pytest.importorskip("lm_eval")
    if not shipped_inventory_available():
        pytest.skip("no shipped default inventory")
    from click.testing import CliRunner

    from adapters_store.backbone.load import hf_dir
    from adapters_store.store.directory import DirectoryStore
    from adapters_store.store.materialize import task_layers
    from training.cli import _routed, eval_cmd
    from training.evaluate import evaluate_task
    from training.shipped_inventory import install_default_inventory
    from training.suite import examples as suite_examples
    from training.suite import parse_task

    settings = settings_for(tmp_path, backbone="default", dtype="float32", max_batch_rows=16, warmup=False)
    install_default_inventory(DirectoryStore(settings.store_dir))  # before the server's start-up clock runs
    hf_dir("default")
    with live_server(settings) as srv:
        rt = srv.runtime
        tok = rt.tokenizer
        task = next(r.id for r in sorted(rt.registry.list(), key=lambda r: r.id)
                    if r.status == "ready" and _procedural(parse_task, r.id))
        exs = suite_examples(parse_task(task), N, seed=0, split="test")
        docs = []
        for i, ex in enumerate(exs):
            other = next(e.output for e in exs[i + 1:] + exs[:i] if e.output != ex.output)
            choices = [ex.output, other] if i % 2 == 0 else [other, ex.output]
            docs.append({"input": ex.input, "output": ex.output, "choices": choices, "label": i % 2})
        data = tmp_path / "docs.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        eval_file = tmp_path / "eval.jsonl"
        eval_file.write_text("".join(json.dumps({"task": task, "input": e.input, "output": e.output}) + "\n"
                                     for e in exs))
        # polyserve eval's budget: the longest reference + 2 tokens
        max_tokens = max(len(tok(" " + e.output, add_special_tokens=False).input_ids) for e in exs) + 2
        (tmp_path / "tasks").mkdir()
        (tmp_path / "tasks" / "gen.yaml").write_text(GEN_YAML.format(data=data, eos=json.dumps(tok.eos_token),
                                                                     max_tokens=max_tokens))
        (tmp_path / "tasks" / "mc.yaml").write_text(MC_YAML.format(data=data))
        tokenizer_dir = hf_dir("default")
        got = {model: harness(tmp_path, srv.url, model, tokenizer_dir) for model in (task, "base")}

        # polyserve's own numbers
        cli = CliRunner().invoke(eval_cmd, ["--store", str(settings.store_dir), "--tasks", task, "--n", str(N),
                                            "--examples", str(eval_file), "--backbone", "default",
                                            "--json-out", str(tmp_path / "eval.json")])
        assert cli.exit_code == 0, cli.output
        own = json.loads((tmp_path / "eval.json").read_text())["tasks"][task]
        store = rt.registry.store
        _, rm, info, skills = _routed(store, "default")
        record = store.get_task(task)
        layers = task_layers(info, skills, str(record.kind), store.load_weights(record))
        base_em = evaluate_task(rm, None, tok, exs)["exact_match"]

    assert got[task]["polyserve_gen"]["exact_match,strip"] == pytest.approx(own["exact_match"])
    assert got["base"]["polyserve_gen"]["exact_match,strip"] == pytest.approx(base_em)
    assert got[task]["polyserve_mc"]["acc,none"] == pytest.approx(choice_acc(rm, layers, tok, docs))
    assert got["base"]["polyserve_mc"]["acc,none"] == pytest.approx(choice_acc(rm, None, tok, docs))
    print(json.dumps({"task": task, "harness": {m: {k: v for k, v in r.items()} for m, r in got.items()},
                      "eval": own, "base_exact_match": base_em}))


def _procedural(parse, name: str) -> bool:
    try:
        parse(name)
    except ValueError:
        return False
    return True
