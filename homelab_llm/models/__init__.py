"""Models on disk (scan, describe), fit verdicts from the memory plan, and pulls from the Hub."""
