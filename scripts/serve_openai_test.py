#!/usr/bin/env python3
"""Talk to a running `metashard serve` with the official `openai` client (tests/serve.rs starts
the server and runs this): completions and chat completions, whole and streamed, from 8 clients
at once, each text equal to the one `metashard run` gave for the same prompt (--expect, a JSON
list of {"prompt", "chat", "text"}); clients that close their streams early free their slots
(`/metrics`); log-probabilities (a streamed chat completion's equal a whole one's); then the
4xx cases: max_tokens 0, a bad temperature, a prompt past the context, `top_logprobs` without
`logprobs`, malformed JSON, a wrong type, a missing and a wrong API key."""
import argparse
import concurrent.futures
import json
import sys
import time
import urllib.error
import urllib.request

import openai

ap = argparse.ArgumentParser()
ap.add_argument("--base-url", required=True)
ap.add_argument("--api-key", required=True)
ap.add_argument("--expect", required=True)
ap.add_argument("--max-tokens", type=int, required=True)
args = ap.parse_args()
cases = json.load(open(args.expect))
client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300)
model = client.models.list().data[0].id


def one(case, stream):
    kw = dict(model=model, max_tokens=args.max_tokens, temperature=0, seed=1)
    if case["chat"]:
        msgs = [{"role": "user", "content": case["prompt"]}]
        if not stream:
            r = client.chat.completions.create(messages=msgs, **kw)
            return r.choices[0].message.content, r.usage.completion_tokens
        text = ""
        for ch in client.chat.completions.create(messages=msgs, stream=True, **kw):
            if ch.choices and ch.choices[0].delta.content:
                text += ch.choices[0].delta.content
        return text, None
    if not stream:
        r = client.completions.create(prompt=case["prompt"], **kw)
        return r.choices[0].text, r.usage.completion_tokens
    text = ""
    for ch in client.completions.create(prompt=case["prompt"], stream=True, **kw):
        text += ch.choices[0].text
    return text, None


jobs = [(c, s) for c in cases for s in (False, True)]
failed = 0
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    for (c, s), (text, used) in zip(jobs, pool.map(lambda j: one(*j), jobs)):
        ok = text == c["text"] and (used is None or 0 < used <= args.max_tokens)
        print(f"{'ok  ' if ok else 'FAIL'} chat={c['chat']} stream={s} {c['prompt']!r}: {text!r}"
              + ("" if ok else f" != {c['text']!r}"))
        failed += not ok


# Log-probabilities through the client's types: a streamed chat completion gives the entries a
# whole one gives, and a completion's four lists come with one item per token.
def entries(content):
    return [(e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs])
            for e in content]


msgs = [{"role": "user", "content": cases[0]["prompt"]}]
kw = dict(model=model, max_tokens=args.max_tokens, temperature=0, logprobs=True, top_logprobs=2)
whole = entries(client.chat.completions.create(messages=msgs, **kw).choices[0].logprobs.content)
parts = []
for ch in client.chat.completions.create(messages=msgs, stream=True, **kw):
    if ch.choices and ch.choices[0].logprobs:
        parts += entries(ch.choices[0].logprobs.content)
ok = len(whole) > 0 and whole == parts and all(len(e[3]) == 2 for e in whole)
print(f"{'ok  ' if ok else 'FAIL'} chat logprobs, whole and streamed: {len(whole)} and {len(parts)} tokens")
failed += not ok
lp = client.completions.create(model=model, prompt=cases[0]["prompt"], max_tokens=4, temperature=0,
                               logprobs=2).choices[0].logprobs
ok = len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
print(f"{'ok  ' if ok else 'FAIL'} completion logprobs: {lp.tokens} {lp.token_logprobs}")
failed += not ok


def expect_status(status, fn, what):
    global failed
    try:
        fn()
        print(f"FAIL {what}: no error")
        failed += 1
    except openai.APIStatusError as e:
        ok = e.status_code == status and "message" in e.body
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {e.status_code} {e.body}")
        failed += not ok


def metric(name):
    root = args.base_url.rsplit("/v1", 1)[0]
    req = urllib.request.Request(root + "/metrics", headers={"Authorization": "Bearer " + args.api_key})
    for line in urllib.request.urlopen(req).read().decode().splitlines():
        if line.startswith("metashard_" + name + " "):
            return float(line.split()[1])
    raise KeyError(name)


# Clients that go away after their first chunk free their slots: none is running soon after
# (left running, each would hold its slot for the ~250 tokens its context allows).
streams = [client.completions.create(model=model, prompt=c["prompt"], max_tokens=100000,
                                     temperature=0, stream=True) for c in cases]
for st in streams:
    next(iter(st))
    st.close()
t0 = time.time()
while metric("requests_running") + metric("requests_queued") > 0 and time.time() - t0 < 10:
    time.sleep(0.1)
held = metric("requests_running") + metric("requests_queued")
print(f"{'ok  ' if held == 0 else 'FAIL'} closed streams: {held} requests held after {time.time() - t0:.1f} s")
failed += held != 0

p = cases[0]["prompt"]
expect_status(400, lambda: client.completions.create(model=model, prompt=p, max_tokens=0), "max_tokens 0")
expect_status(400, lambda: client.completions.create(model=model, prompt=p, temperature=-1), "temperature -1")
expect_status(400, lambda: client.completions.create(model=model, prompt="word " * 5000), "prompt past the context")
expect_status(400, lambda: client.chat.completions.create(model=model, messages=[], max_tokens=4), "no messages")
expect_status(400, lambda: client.chat.completions.create(model=model, messages=msgs, top_logprobs=2),
              "top_logprobs without logprobs")
for key, what in [("wrong", "wrong API key")]:
    bad = openai.OpenAI(base_url=args.base_url, api_key=key, max_retries=0)
    expect_status(401, lambda: bad.models.list(), what)
req = urllib.request.Request(args.base_url + "/completions", data=b"{not json",
                             headers={"Content-Type": "application/json",
                                      "Authorization": "Bearer " + args.api_key})
for body, auth, status, what in [(b"{not json", True, 400, "malformed JSON"),
                                 (b'{"prompt": "x"}', False, 401, "missing API key"),
                                 (b'{"prompt": 5}', True, 400, "prompt of the wrong type")]:
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = "Bearer " + args.api_key
    try:
        urllib.request.urlopen(urllib.request.Request(args.base_url + "/completions", data=body, headers=headers))
        print(f"FAIL {what}: no error")
        failed += 1
    except urllib.error.HTTPError as e:
        msg = json.load(e)["error"]["message"]
        ok = e.code == status
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {e.code} {msg}")
        failed += not ok
total = metric("requests_total")
ok = metric("requests_running") == 0 and total >= len(jobs) + len(streams)
print(f"{'ok  ' if ok else 'FAIL'} metrics: {total} requests, none running")
failed += not ok
sys.exit(1 if failed else 0)
