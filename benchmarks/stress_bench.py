"""The stage link under stress: many sessions, every codec, emulated links, oversubscribed cores.

    python benchmarks/stress_bench.py [--devices 12] [--steps 3] [--seconds 600] [--json]

(with fedpipe installed, or from the repo root with ``PYTHONPATH=benchmarks``). Every device's
replies under load are compared bit for bit with its run on an idle machine; exits 1 when any
differs or fails. See ``benchmarks/fedpipe_bench/stress.py``.
"""

from fedpipe_bench.stress import main

if __name__ == "__main__":
    main()
