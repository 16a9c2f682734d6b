"""The device: its stages and adapters (:mod:`~fedpipe.edge.trainer`), the pipeline runtime that
walks a schedule (:mod:`~fedpipe.edge.runtime`, :mod:`~fedpipe.edge.schedules`), and the
per-device planner (:mod:`fedpipe.edge.planner`)."""
