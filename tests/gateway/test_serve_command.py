"""`strata serve` as the README's `make serve` runs it: no model given, so the generated demo model; Ctrl-C stops it.

Stopping must leave nothing behind: the gateway process exits on SIGINT by itself (the helper would otherwise kill
it and fail the test), and every process it started, and every process in their process groups, is gone.
"""

from __future__ import annotations

import time

from openai import OpenAI
from strata_testbed.serve import living, process_tree, strata_serve

STOP_TIMEOUT_S = 15.0


def test_serve_without_a_model_answers_a_chat_and_ctrl_c_leaves_no_process() -> None:
    with strata_serve(timeout_s=180, stop_timeout_s=STOP_TIMEOUT_S) as served:
        tree = process_tree(served.process.pid)
        assert len(tree) >= 2, f"strata serve and its stage worker run: {tree}"
        reply = OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=60).chat.completions.create(
            model=served.model,
            messages=[{"role": "user", "content": "Hello there."}],
            max_tokens=6,
            temperature=0,
        )
        assert served.model == "strata-test-qwen2", "the demo model is the generated one"
        assert reply.usage is not None
        assert reply.usage.completion_tokens == 6 or reply.choices[0].finish_reason == "stop"
        stopping = time.monotonic()
    assert served.process.returncode == 0, "Ctrl-C is the normal way out"
    pids, groups = set(tree), set(tree.values())
    left = living(pids=pids, groups=groups)
    deadline = time.monotonic() + 2.0  # a grandchild killed with its parent's group may take a moment to go
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = living(pids=pids, groups=groups)
    assert left == set(), f"processes left after Ctrl-C: {left}"
    print(f"strata serve and {len(pids) - 1} descendants gone {time.monotonic() - stopping:.2f} s after SIGINT")
