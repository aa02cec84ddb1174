"""Structured outputs: grammars (JSON schema, regex, choice, Lark/GBNF, tool calls) that constrain
decoding through a token bitmask applied in the sampler. `grammar.py` turns a request's constraint
into one llguidance grammar; `matcher.py` compiles it (cached) and keeps each sequence's state."""
