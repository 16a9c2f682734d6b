"""A run on disk and on the console: the run folder and checkpoints (:mod:`~fedpipe.runs.folder`),
resuming (:mod:`~fedpipe.runs.resume`), summary.json (:mod:`~fedpipe.runs.summary`), the live
console report (:mod:`~fedpipe.runs.report`), plots and TensorBoard; a checkpoint as a PEFT
adapter or a merged model (:mod:`~fedpipe.runs.export`), and answers from it
(:mod:`~fedpipe.runs.generate`)."""
