"""The StageServer: the middle of the model, shared by many device sessions.

Built by :func:`~fedpipe.server.build.build_stage_server` from settings. Its parts, one idea a
module: the runtime (sessions, streams, the compute worker, round commit) in
:mod:`~fedpipe.server.runtime`; which ready work runs together in
:mod:`~fedpipe.server.batch_policy` over :mod:`~fedpipe.server.fair_queue`; the batched compute
in :mod:`~fedpipe.server.executor`; host/GPU copies in :mod:`~fedpipe.server.device_copies`;
devices' delta caches between rounds in :mod:`~fedpipe.server.delta_store`.
"""
