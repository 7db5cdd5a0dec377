"""The `gradacc` command line (main.py) and its demo: model, data, plot, probe and environment report."""

from .main import main

__all__ = ["main"]
