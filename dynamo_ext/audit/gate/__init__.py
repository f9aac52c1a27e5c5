"""The CI gate: budgets, the baseline and the diff of two reports."""
