"""``shardwise plan``'s command line: its flags and their parsers without torch (``args.py``), and the command that
prints every layout of a model on a cluster (``cli.py``)."""
