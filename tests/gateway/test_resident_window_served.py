"""`strata serve --resident-window`: stages told the window through the environment decode a long conversation over
it, and what a window leaves exact (the prompt, and the first step after it) answers as the exact server does."""

from __future__ import annotations

from pathlib import Path

import httpx
from strata_testbed.serve import Served, strata_serve

PROMPT = [3 + (37 * i) % 990 for i in range(2000)]  # past the window: sinks, chosen blocks and recent positions
WINDOW = 1344  # 64 sink positions, 1024 recent ones (and the block they grow by), three blocks chosen


def _complete(served: Served, max_tokens: int) -> dict[str, object]:
    request = {"model": served.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{served.base_url}/completions", json=request, timeout=120)
    assert response.status_code == 200, response.text
    choice: dict[str, object] = response.json()["choices"][0]
    return choice


def test_a_resident_window_serves_a_long_conversation_and_its_exact_steps_match(qwen2_model: Path) -> None:
    args = (str(qwen2_model), "--stages", "2", "--parallel", "1", "--context", "4096")
    with strata_serve(*args) as exact:
        first = _complete(exact, 2)
    with strata_serve(*args, "--resident-window", str(WINDOW)) as windowed:
        assert _complete(windowed, 2)["text"] == first["text"], "the prompt and the first decode step are exact"
        long = _complete(windowed, 80)
        endpoint = windowed.output.wait_for(lambda line: "stage logs in" in line, timeout=0) or ""
        logs = Path(endpoint.rsplit("stage logs in ", 1)[1].rstrip(")\n "))
        said = "".join(path.read_text() for path in logs.glob("*.log"))
    assert long["finish_reason"] == "length"
    assert str(long["text"]).startswith(str(first["text"]))
    for layers in ("[0, 2)", "[2, 4)"):
        assert f"layers {layers}: decode attends over a resident window of at most {WINDOW} positions" in said
