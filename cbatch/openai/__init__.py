"""OpenAI's request and response shapes mapped onto cbatch's, knowing nothing of HTTP: the
HTTP server (cbatch/http_api), cbatch-submit's OpenAI batch files (cbatch/cli) and the batch
jobs (cbatch/jobs) all read requests and write answers through these modules, so every way
in accepts the same fields and answers in the same shape."""
