"""How a chat or completions answer ends, in terms OpenAI's clients know: the HTTP API
never sends a finish_reason OpenAI does not have (cbatch's own `cancelled`), against a
real daemon with --http."""

import json
import signal
import threading

import httpx
from daemonkit import wait_until
from httpkit import HttpDaemon

LONG = {"max_tokens": 16000, "ignore_eos": True, "temperature": 0}


def test_a_drain_that_cancels_running_answers_ends_them_with_shutting_down(tiny_model_path):
    """The drain's grace ends while a streamed completion and a whole one run: the
    stream's text so far, then an error event (code shutting_down) and [DONE]; the whole
    answer a 503 shutting_down, which a router retries elsewhere."""
    daemon = HttpDaemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 16384), "--drain-grace", "1")
    whole = {}

    def post_whole() -> None:
        whole["response"] = httpx.post(f"{daemon.base_url}/v1/completions", json={"prompt": "x", **LONG},
                                       timeout=300)

    poster = threading.Thread(target=post_whole)
    try:
        body = {"prompt": "go", "stream": True, **LONG}
        with httpx.stream("POST", f"{daemon.base_url}/v1/completions", json=body, timeout=300) as running:
            lines = running.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            poster.start()
            with daemon.client() as client:
                wait_until(lambda: client.stats()["num_active"] == 2, 60)
            daemon.process.send_signal(signal.SIGTERM)
            events = [first] + [line for line in lines if line.startswith("data: ")]
        poster.join(300)
        assert daemon.process.wait(60) == 0, daemon.log()
    finally:
        daemon.stop()
        if poster.ident is not None:
            poster.join(300)
        daemon.remove_workdir()
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(event[len("data: "):]) for event in events[:-1]]
    assert payloads[-1]["error"]["code"] == "shutting_down", payloads[-1]
    chunks = payloads[:-1]
    assert all(choice["finish_reason"] is None for chunk in chunks for choice in chunk["choices"])
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks)  # the text before the cut
    response = whole["response"]
    assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down", response.text
    assert response.headers["retry-after"] == "1"
    assert "cancelled" not in response.text and not any("cancelled" in event for event in events)
