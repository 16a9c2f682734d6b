"""Starting and stopping processes: Flower's SuperLink, SuperNodes and engines
(:mod:`~fedpipe.launch.processes`, :mod:`~fedpipe.launch.engines`), and the watchdog that
leaves no process behind (:mod:`~fedpipe.launch.watchdog`)."""
