"""The batch-file engine that cbatch-submit (cbatch/cli/) and the batch job runner
(cbatch/jobs/) both run: a file's lines read (input_lines), the native and OpenAI line
formats (native_batch, openai_batch), the keys that name each line's result (line_keys),
a run with a bounded number of requests in flight (batch_run), and what a resumed run skips
(resume). It imports neither the command line nor the jobs.
"""
