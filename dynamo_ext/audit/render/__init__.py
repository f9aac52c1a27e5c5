"""Renderers of a report: the terminal text, the single-file HTML, and the communication tables of both."""
