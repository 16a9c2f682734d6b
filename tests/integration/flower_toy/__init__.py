"""A toy Flower app used only by the engine tests: FedAvg over two tiny arrays.

Importable as ``flower_toy`` when ``tests/integration`` is on ``PYTHONPATH``; the
engine helpers point a generated Flower app project at ``flower_toy.server:app`` and
``flower_toy.client:app`` so the processes import this package, not a bundled copy.
"""
