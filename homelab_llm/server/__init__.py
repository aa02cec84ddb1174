"""The OpenAI-compatible server (`homelab-llm serve`). Which file owns what, in request order:

    command.py        the `serve` subcommand: flags (vLLM spelling), presets as defaults
    launch.py         uvicorn with our shutdown: drain on SIGTERM, then abort, exit 0
    app.py            FastAPI app: API-key middleware, error handlers, /health /v1/status /metrics
    openai.py         routes: /v1/chat/completions /v1/completions /v1/models /tokenize /detokenize
    protocol.py       request bodies (pydantic) -> SamplingParams; the context-length check
    chat.py           chat: template, tokenize, n choices, JSON or SSE chunks
    completions.py    completions: prompt batches, echo, legacy logprobs
    generation.py     Batch: one HTTP request's engine requests, merged outputs, abort on exit
    chat_text.py      routes chat text to reasoning_content / tool_calls / content
    reasoning_parser.py, tool_parser.py, text_scan.py   <think> and Hermes <tool_call> parsing
    engine_client.py  the engine's own thread behind an async client (inbox in, queues out)
    stats.py          counters, histograms, sliding-window throughput, latency percentiles
    metrics.py, status.py   /metrics (Prometheus text) and /v1/status (DESIGN.md contract)
    errors.py, sse.py, logprobs.py, state.py   error bodies, SSE frames, logprob shapes, settings
"""
