"""Targets bundled with the audit (``dynamo-ext audit`` without TARGET runs :mod:`.example_llama`)."""
