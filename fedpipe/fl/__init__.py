"""Flower only: the ServerApp (:mod:`~fedpipe.fl.server_app`) and the ClientApp
(:mod:`~fedpipe.fl.client_app`); how a round's adapters are aggregated beside the strategy
(:mod:`~fedpipe.fl.aggregate`); a device's round of work (:mod:`~fedpipe.fl.device_work`);
round bookkeeping (:mod:`~fedpipe.fl.deadline_grid`); strategies (:mod:`~fedpipe.fl.strategies`) and
Flower's DP wrappers on adapters (:mod:`~fedpipe.fl.adapter_dp`).
"""
