"""Stages prepare, filter and tokenize: the corpus, its quality filters and poison pool, the
byte-level BPE and the token shards (flows/data.py runs them); and the unigram baseline of the
shards, the loss a model reaches on frequencies alone (unigram.py)."""
