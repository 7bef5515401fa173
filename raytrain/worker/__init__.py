"""WORKER side: the training loop for one rank, evaluation, resume and the run's state (run_state),
the Protocol of what they use of a Trainer, and the one module that calls Ray Train's worker API
(ray_worker, preemption). Everything here runs without Ray, except those two."""
