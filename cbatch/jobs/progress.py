"""A batch job's progress, beside OpenAI's `request_counts`: the tokens its lines took and
made, how fast its lines finish and when the rest should be done.

The runner keeps it in the job's `progress` object (RunProgress, written with the counts);
the daemon's STATS reply, and so cbatch-status and /metrics, read it back from the state
directory (cbatch.jobs.overview).
"""

import time


def initial_progress() -> dict:
    """`eta_s` is null until a line has finished in the current run (no rate yet)."""
    return {"prompt_tokens": 0, "generated_tokens": 0, "lines_per_s": 0.0, "tokens_per_s": 0.0, "eta_s": None}


def usage_tokens(result: dict) -> tuple[int, int]:
    """(prompt, generated) tokens of a finished line's response, as its usage says:
    chat and completions, embeddings (prompt only) and responses (input and output)."""
    response = result.get("response") or {}
    usage = (response.get("body") or {}).get("usage") if response.get("status_code") == 200 else None
    if not isinstance(usage, dict):
        return 0, 0
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
    return prompt, usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0


class RunProgress:
    """The rates of the current run of a job (since the runner started or resumed it):
    lines that finished in an earlier run say nothing of how fast this one goes."""

    def __init__(self, num_done_before: int, num_generated_before: int):
        self.started_s = time.monotonic()
        self.num_done_before = num_done_before
        self.num_generated_before = num_generated_before

    def of(self, num_total: int, num_done: int, num_prompt_tokens: int, num_generated_tokens: int) -> dict:
        elapsed_s = max(time.monotonic() - self.started_s, 1e-9)
        lines_per_s = (num_done - self.num_done_before) / elapsed_s
        eta_s = round(max(num_total - num_done, 0) / lines_per_s, 1) if lines_per_s > 0 else None
        return {"prompt_tokens": num_prompt_tokens, "generated_tokens": num_generated_tokens,
                "lines_per_s": round(lines_per_s, 2),
                "tokens_per_s": round((num_generated_tokens - self.num_generated_before) / elapsed_s, 1),
                "eta_s": eta_s}
