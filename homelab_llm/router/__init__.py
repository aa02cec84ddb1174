"""One OpenAI endpoint in front of the presets: start on demand, idle unload, GPU-budget swaps."""
