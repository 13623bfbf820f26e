"""The benchmarks `scripts/bench.py NAME` runs, one module each with its own options
(`main()` reads them), and what they share: the options most of them take (options: the
model and the counts a bench is sized by), the peers they start and measure against
(peers: a cbatch daemon, llama-server, and waiting for an HTTP server), the callers in the
bench's own process (callers: closed loops of client threads over the ZeroMQ Client or
HTTP, one Client's batch), the light HTTP load generator that runs as a process of its own
(loadgen), the processes' CPU read from /proc (proc_cpu), the one way a bench prints its
figures (report: tables and notes) and the schema suite (schema_suite)."""
