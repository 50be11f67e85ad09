"""guidellm (vLLM's load client), unchanged, against a live server (tiny random backbone): a short
synchronous run on completions and on multi-turn chat, every request answered. It streams with
stream_options {include_usage, continuous_usage_stats}, vLLM's extension."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adapters_store.backbone.tiny import tiny_tokenizer
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

# guidellm runs as its own command; importing it here would start a child process of its own in
# the test process for the rest of the session
if importlib.util.find_spec("guidellm") is None:
    pytest.skip("guidellm is not installed", allow_module_level=True)
GUIDELLM = Path(sys.executable).with_name("guidellm")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("guidellm")
    build_store(root / "store")
    with live_server(settings_for(root, max_new_tokens=32, max_prompt_tokens=256), tiny_backbone()) as srv:
        yield srv


@pytest.mark.skipif(not GUIDELLM.exists() and shutil.which("guidellm") is None, reason="no guidellm script")
@pytest.mark.parametrize(("route", "data"), [("/v1/completions", ""), ("/v1/chat/completions", ",turns=3")],
                         ids=["completions", "chat-multi-turn"])
def test_a_short_guidellm_run_has_no_errors(server, tmp_path, route, data):
    tokenizer = tmp_path / "tokenizer"  # guidellm counts tokens with the served tokenizer (no hub)
    tiny_tokenizer().save_pretrained(tokenizer)
    report = tmp_path / "report.json"
    cmd = [str(GUIDELLM if GUIDELLM.exists() else shutil.which("guidellm")), "run",
           "--backend", f"kind=openai_http,target={server.url},model=base,request_format={route}",
           "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=4",
           "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens=8{data}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals == {"successful": 4, "errored": 0, "incomplete": 0, "total": 4}, totals
