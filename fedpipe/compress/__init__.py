"""What shrinks the stage link's bytes, as tensor math (no gRPC): low-bit quantisation with
groups and outliers (:mod:`~fedpipe.compress.lowbit`), error feedback for gradients
(:mod:`~fedpipe.compress.feedback`), and delta coding of activations a device sends again
(:mod:`~fedpipe.compress.delta`). The wire (:mod:`fedpipe.wire.tensors`) frames their output."""
