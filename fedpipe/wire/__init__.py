"""The wire: the only part of fedpipe that imports the generated gRPC stubs (``fedpipe.proto``).

- :mod:`~fedpipe.wire.tensors` and :mod:`~fedpipe.wire.serde`: tensors and stage messages to and
  from protobuf, framed with one copy; :mod:`~fedpipe.wire.stream_codec`: a stream's codecs;
- :mod:`~fedpipe.wire.link_client`: the device's side of the stage link (channels, sessions);
- :mod:`~fedpipe.wire.link_servicer`, :mod:`~fedpipe.wire.control_servicer`: the StageServer's
  servicers, which translate and delegate to a :class:`~fedpipe.wire.backend.StageBackend`;
  :mod:`~fedpipe.wire.host`: the gRPC server they run in;
- :mod:`~fedpipe.wire.channels`: channel options, TLS, reconnecting;
- :mod:`~fedpipe.wire.control_client`: the ServerApp's round control calls;
- :mod:`~fedpipe.wire.status`: errors to gRPC status codes and back, retries.
"""
