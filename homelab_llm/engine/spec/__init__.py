"""Speculative decoding: draft proposers (ngram.py, mtp.py), the --speculative-config flag
(config.py), verification and acceptance (verify.py) and the counters behind /metrics (stats.py)."""
