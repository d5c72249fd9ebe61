"""`fulcrum bench`: closed- and open-loop load over HTTP, honest latency, tables and plots.

Python API: `fulcrum.loadgen.bench.run_bench(BenchOptions) -> BenchRun`; several labelled runs
side by side: `fulcrum.loadgen.report.compare_table(runs)`. Kept empty so `fulcrum serve`,
which looks this package up to register `bench`, does not import it.
"""
