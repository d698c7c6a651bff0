"""GPU tests (skipped without CUDA). A package, so that its conftest does not shadow tests/conftest.py
(both would be imported as the module ``conftest``)."""
