"""The parameter server: the worker's module (``module.py``) and the server roles (``roles.py``). Our engine
only: torch has no parameter server."""
