"""Stages prepare, filter and tokenize: the corpus, its quality filters and poison pool, the
byte-level BPE and the token shards (flows/data.py runs them)."""
