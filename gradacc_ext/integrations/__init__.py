"""Adapters for training frameworks. Each lives in its own module, which imports its framework;
importing gradacc_ext imports none of them (docs/frameworks.md)."""
