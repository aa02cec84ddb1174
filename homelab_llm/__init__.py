"""homelab-llm: a home-lab control app with its own local LLM inference engine."""

__version__ = "0.1.0"
