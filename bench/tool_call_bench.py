"""A tool-call request against a plain request of the same length, on a real server (native engine).

    tool    POST /v1/chat/completions with tools and tool_choice named (or required): the grammar
            masks every step, the answer is parsed into tool_calls
    plain   POST /v1/completions with the tool request's own rendered prompt (same tokens) and
            max_tokens = its completion tokens with ignore_eos (same length), no grammar
Rounds alternate the two, sequentially (one request in flight); the prefix cache is off so both
compute their whole prompt. Prints the median latency of each and their ratio (the target:
at most 1.2x).

    .venv/bin/python -m bench.tool_call_bench [--rounds 20] [--choice named|required]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

from bench.local_server import polyserve_server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "time", "description": "The local time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                          "maxLength": 20}}, "required": ["city"],
                                                          "additionalProperties": False}}}]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What will the weather be in Paris for the next three days, in celsius?"}]


def timed(client: httpx.Client, path: str, body: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    r = client.post(path, json=body)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    return elapsed, r.json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--choice", choices=["named", "required"], default="named")
    args = ap.parse_args()
    choice = {"type": "function", "function": {"name": "weather"}} if args.choice == "named" else "required"
    tool_body = {"model": "base", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 64,
                 "temperature": 0, "parallel_tool_calls": False, "return_prompt_text": True}
    with polyserve_server({"POLYSERVE_PREFIX_CACHE_TOKENS": "0"}) as url, httpx.Client(base_url=url, timeout=300) as c:
        _, first = timed(c, "/v1/chat/completions", tool_body)
        assert first["choices"][0]["message"].get("tool_calls"), first
        plain_body = {"model": "base", "prompt": first["prompt_text"], "add_special_tokens": False, "temperature": 0,
                      "max_tokens": first["usage"]["completion_tokens"], "ignore_eos": True}
        _, check = timed(c, "/v1/completions", plain_body)
        assert check["usage"] == {**first["usage"], **{k: check["usage"][k] for k in ("prompt_tokens_details",)
                                                       if k in check["usage"]}}, (check["usage"], first["usage"])
        tool_s, plain_s = [], []
        for _ in range(args.rounds):
            tool_s.append(timed(c, "/v1/chat/completions", tool_body)[0])
            plain_s.append(timed(c, "/v1/completions", plain_body)[0])
    tool_m, plain_m = statistics.median(tool_s), statistics.median(plain_s)
    print(json.dumps({"choice": args.choice, "rounds": args.rounds, "prompt_tokens": first["usage"]["prompt_tokens"],
                      "completion_tokens": first["usage"]["completion_tokens"],
                      "tool_median_s": round(tool_m, 4), "plain_median_s": round(plain_m, 4),
                      "ratio": round(tool_m / plain_m, 3)}))


if __name__ == "__main__":
    main()
