"""Flower only: the ServerApp and ClientApp (:mod:`~fedpipe.fl.apps`), a device's round of
work (:mod:`~fedpipe.fl.device_work`), round bookkeeping (:mod:`~fedpipe.fl.rounds`), strategies
(:mod:`~fedpipe.fl.strategies`) and Flower's DP wrappers on adapters
(:mod:`~fedpipe.fl.adapter_dp`).
"""
