"""Protobuf and gRPC modules generated from ``protos/fedpipe/proto/*.proto``.

Never edit these files by hand: change the ``.proto`` and run ``python scripts/gen_protos.py``.
Only ``fedpipe.transport`` imports them.
"""
