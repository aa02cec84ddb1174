"""The OpenAI-compatible server (`homelab-llm serve`). Which file owns what, in request order:

    command.py        the `serve` subcommand: flags (vLLM spelling), presets as defaults
    launch.py         bind the port first, uvicorn with our shutdown: drain on SIGTERM, then abort,
                      exit 0; a second signal aborts at once and exits non-zero
    app.py            FastAPI app: middleware, error handlers, /health /v1/status /metrics
    middleware.py     ASGI guards: 500s with error ids, Host allow-list, API key
    hosts.py          loopback names and the Host allow-list rule (no web imports)
    openai.py         routes: /v1/chat/completions /v1/completions /v1/models /tokenize /detokenize
    body.py           JSON bodies: content type, size cap (413), every decode failure a 400
    protocol.py       request bodies (pydantic) -> SamplingParams; the context-length check
    limits.py         cheap bounds before expensive work: body counts, prompt characters, prompts x n
    chat.py           chat: template, tokenize, n choices, JSON or SSE chunks
    completions.py    completions: prompt batches, echo, legacy logprobs
    generation.py     Batch: one HTTP request's engine requests, merged outputs, abort on exit
    chat_text.py      routes chat text to reasoning_content / tool_calls / content
    reasoning_parser.py, text_scan.py   <think> parsing, and what the stream parsers share
    tool_parser.py    the --tool-call-parser table: tool_hermes.py (<tool_call>), tool_json.py
                      (llama3_json, mistral), tool_call.py (the call, the delta, the content gate)
    client_base.py    the routes' engine client: per-request queues, drain, abort, lifecycle state
    engine_process.py the engine in its own process (serve's default): one pipe, outputs per step
    engine_core.py    that process: load the engine, run the step loop, die with the server
    engine_client.py  the engine in a thread of the server instead (--engine-in-process)
    step_loop.py      the step loop either one runs: commands in, step, outputs out; dead engines
    stats.py          counters, histograms, sliding-window throughput, latency percentiles
    metrics.py, status.py   /metrics (Prometheus text) and /v1/status (DESIGN.md contract)
    errors.py, sse.py, logprobs.py, state.py   error bodies, SSE frames, logprob shapes, settings
"""
