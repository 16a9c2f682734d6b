"""The test suite's scaffolding, shared by every tier (no test module imports another).

- :mod:`harness.stage`: the StageServer factory, and a gate on its compute worker;
- :mod:`harness.deploy`: the deployment starter (server + SuperLink + N SuperNodes);
- :mod:`harness.processes`: processes a test starts, and the process-tree check;
- :mod:`harness.certs`: the certificate maker (CA, loopback certificates, node keys);
- :mod:`harness.faults`: devices that die or go silent in a simulation (a test ClientApp);
- :mod:`harness.waits`: ``wait_for``;
- :mod:`harness.close`: ``assert_close_to_scale``, the one rule for comparing two float
  computations (relative to the tensor's scale), and its state-dict form;
- :mod:`harness.export`: tiny models of every family, run folders with trained-looking
  checkpoints, and the split model's logits for them (the export tests);
- :mod:`harness.flower_toy`: a toy Flower app for the engine tests;
- :mod:`harness.fixtures`: the pytest fixtures ``tests/conftest.py`` registers.

``tests`` is on ``sys.path`` (pytest's ``pythonpath``) and on ``PYTHONPATH`` for the processes
the suite starts, so a simulation's ClientApp processes import ``harness.faults`` too.
"""
