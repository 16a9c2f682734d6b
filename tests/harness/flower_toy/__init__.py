"""A toy Flower app used only by the engine tests: FedAvg over two tiny arrays.

Importable as ``harness.flower_toy`` (``tests`` is on ``PYTHONPATH`` for the processes the
suite starts); the engine tests point a generated Flower app project at
``harness.flower_toy.server:app`` and ``harness.flower_toy.client:app``.
"""
