"""Background adaptation jobs: register a task from few-shot examples while serving."""
