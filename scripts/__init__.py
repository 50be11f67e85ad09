"""Studies and maintenance scripts. Run each from the repository root as a module: python -m scripts.NAME --help."""
