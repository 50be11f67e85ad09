"""Tools the tests use and that also run on their own with bigger budgets: python -m tests.tools.NAME."""
