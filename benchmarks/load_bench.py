"""32 emulated devices x 20 steps against one StageServer: p50/p95 step time, server memory.

    python benchmarks/load_bench.py [--devices 32] [--steps 20] [--json]

(with fedpipe installed, or from the repo root with ``PYTHONPATH=.``). Prints one JSON object
with ``--json``: ``exact`` (every device's replies equal its solo run's, bit for bit),
``step_p50_s``, ``step_p95_s``, ``rss_mb_at_step5``, ``rss_growth_mb`` and ``peak_rss_mb`` of
the server process. See ``benchmarks/fedpipe_bench/load.py``.
"""

from fedpipe_bench.load import main

if __name__ == "__main__":
    main()
