"""One-off measurements that only docs/history/ cites: each answered a question once (what a change
saved, why a figure moved) and is kept so the note's figure can be re-made. Run them as modules,
`python -m bench.experiments.NAME`; the benchmarks users run are in bench/."""
